"""The streaming-corpus DDP recipe of stream_original.py as `torchgpu train` specs: the
model, the stream and the loss; sharding over ranks, DDP, steps per epoch, checkpoints, a
saved stop on SIGINT/SIGTERM and ``--autoresume`` are torchgpu's. The corpus is the file
named by $CORPUS.

    CORPUS=corpus.txt torchgpu train --model examples/recipes/stream_torchgpu.py:model \\
        --data examples/recipes/stream_torchgpu.py:stream \\
        --loss examples/recipes/stream_torchgpu.py:lm_loss --optimizer adamw \\
        --nproc 2 --batch-size 4 --steps-per-epoch 60 --epochs 2 --seed 0 \\
        --save-every 10 --out runs/stream --autoresume
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
from nanogpt_model import GPT, GPTConfig, lm_loss  # noqa: F401  (lm_loss: the --loss spec)
from torch.utils.data import IterableDataset


class TokenWindows(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """The file's bytes as windows of ``block`` tokens and their next tokens, read a
    window at a time (the file is never read whole)."""

    def __init__(self, path: str, block: int) -> None:
        self.path, self.block = path, block

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        with open(self.path, "rb") as f:
            while len(chunk := f.read(self.block + 1)) == self.block + 1:
                tokens = torch.tensor(list(chunk), dtype=torch.long)
                yield tokens[:-1], tokens[1:]


def model() -> GPT:
    return GPT(GPTConfig(block_size=32, vocab_size=256, n_layer=1))


def stream() -> TokenWindows:
    return TokenWindows(os.environ["CORPUS"], 32)
