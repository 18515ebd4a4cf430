"""A user's training script on a stream: torchgpu.fit on :class:`PairStream`. Run alone
it trains in one process; under `torchgpu launch --nproc N` every process runs it and
fit trains DDP on the stream, item i on rank i mod N.

usage: fit_stream_script.py OUT BATCH_SIZE [samples=N] [sized=1] [extra key=value settings]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tests.*

import torch
from torch import nn

from tests.user_models import PairStream, SizedPairStream, stream_model
from torchgpu import fit


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


if __name__ == "__main__":
    out, batch = sys.argv[1], int(sys.argv[2])
    extra = dict(arg.split("=", 1) for arg in sys.argv[3:])
    samples = int(extra.pop("samples", "60"))
    data = SizedPairStream(samples) if extra.pop("sized", "0") == "1" else PairStream(samples)
    result = fit(stream_model, data, loss=nn.MSELoss(), optimizer=sgd, epochs=2,
                 batch_size=batch, out=out, progress="plain", seed=1,
                 **{k: int(v) if v.isdigit() else v for k, v in extra.items()})
    print(f"strategy {result.summary['strategy']} world {result.summary['world_size']} "
          f"steps {result.summary['steps']}", flush=True)
