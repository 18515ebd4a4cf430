"""A streaming corpus under DistributedDataParallel as a plain PyTorch loop (PyTorch's DDP
tutorial with an IterableDataset, torchrun-launched): token windows read lazily from a text
file larger than the run needs, item i to rank i mod W, a fixed number of steps per epoch,
each epoch reading the stream from its start; gloo on CPU. The model is nanoGPT's
(nanogpt_model.py) over bytes. No resume: a stopped run starts over.

    torchrun --nproc-per-node 2 examples/recipes/stream_original.py CORPUS OUT.pt
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from itertools import islice

import torch
import torch.distributed as dist
from nanogpt_model import GPT, GPTConfig, lm_loss
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset

BLOCK, BATCH, STEPS_PER_EPOCH, EPOCHS, SEED = 32, 4, 60, 2, 0


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


class RankShare(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """This rank's items of ``stream``: item i goes to rank i mod world."""

    def __init__(self, stream: TokenWindows, rank: int, world: int) -> None:
        self.stream, self.rank, self.world = stream, rank, world

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return islice(self.stream, self.rank, None, self.world)


def main(corpus: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED)
    model = DDP(GPT(GPTConfig(block_size=BLOCK, vocab_size=256, n_layer=1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(RankShare(TokenWindows(corpus, BLOCK), rank, world), batch_size=BATCH)
    losses = []
    for epoch in range(EPOCHS):
        for x, y in islice(loader, STEPS_PER_EPOCH):
            loss = lm_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            mean = loss.detach().double()  # the global mean loss, summed in float64
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
        if rank == 0:
            print(f"epoch {epoch + 1}: train loss {losses[-1]:.4f}")
    if rank == 0:
        torch.save({"losses": losses, "model": model.module.state_dict()}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(*sys.argv[1:3])
