"""A user's training script: torchgpu.fit on the test causal LM. Run alone it trains in
one process; under `torchgpu launch --nproc N` every process runs it and fit trains DDP.

usage: fit_lm_script.py OUT BATCH_SIZE [samples=N] [extra key=value settings]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tests.*

import torch
from torch import nn

from tests.user_models import TinyCausalLM, TokenDataset
from torchgpu import fit

BUILT: list[int] = []  # model factory calls in this process (a run builds one model)


def model() -> TinyCausalLM:
    BUILT.append(1)
    return TinyCausalLM(dropout=0.0)


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5)


if __name__ == "__main__":
    out, batch = sys.argv[1], int(sys.argv[2])
    extra = dict(arg.split("=", 1) for arg in sys.argv[3:])
    samples = int(extra.pop("samples", "44"))
    result = fit(model, TokenDataset(samples), eval_data=TokenDataset(8, seed=1), optimizer=sgd,
                 epochs=2, batch_size=batch, out=out, progress="plain", seed=1,
                 **{k: int(v) if v.isdigit() else v for k, v in extra.items()})
    print(f"strategy {result.summary['strategy']} world {result.summary['world_size']} "
          f"models built {len(BUILT)}", flush=True)
