"""Two gloo processes on 127.0.0.1 under torchrun: ``GradAccumulator`` under DDP trains
exactly like one process for every order of a window's forwards and backwards --
interleaved, all forwards before their backwards (each forward inside ``micro_step`` or
outside it), mixtures, and a partial window closed by ``flush()`` -- and the ranks keep
one model: the same weights, and the same BatchNorm statistics once DDP's next forward
has broadcast them.

This file is both the pytest test and, run as a script by torchrun, the worker: each
worker writes its findings to JSON and the test asserts on them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

WORLD = 2
K = 3  # micro-steps per window
MICRO = 4  # rows per micro-batch per rank
WINDOWS = 2
# Each order is a window's events: "f" a forward inside micro_step(), "F" one outside
# it, "b" the backward of the oldest forward not yet backpropagated.
ORDERS = {
    "interleaved": "fbfbfb",
    "forwards_first": "fffbbb",
    "forwards_first_outside": "FFFbbb",
    "mixed": "fbffbb",
    "mixed_late": "ffbbfb",
    "partial_flush": "ffbb",  # 2 of 3 micro-steps, then flush()
}


def _model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))


def _data(seed: int) -> Any:
    import torch

    gen = torch.Generator().manual_seed(seed)
    rows = WORLD * K * MICRO
    return torch.randn(rows, 6, generator=gen), torch.randn(rows, 1, generator=gen)


def _rows(i: int, rank: int) -> slice:
    return slice((i * WORLD + rank) * MICRO, (i * WORLD + rank + 1) * MICRO)


def _reference(order: str) -> Any:
    """One process: each window's mean over every rank's micro-batch losses (BatchNorm
    normalises each micro-batch by its own statistics, as on the ranks)."""
    import torch
    from torch import nn

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    steps = order.count("b")
    for w in range(WINDOWS):
        x, y = _data(w)
        for i in range(steps):
            for rank in range(WORLD):
                rows = _rows(i, rank)
                loss = nn.functional.mse_loss(model(x[rows]), y[rows]) / (steps * WORLD)
                loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
    return model


def _run(order: str, rank: int) -> dict[str, Any]:
    import torch
    from torch import nn

    from torchgpu.accumulate import GradAccumulator
    from torchgpu.parallel.data import wrap_data_parallel

    ref = _reference(order)
    ddp = wrap_data_parallel(_model(), "ddp")
    acc = GradAccumulator(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9), steps=K)
    for w in range(WINDOWS):
        x, y = _data(w)
        losses: list[torch.Tensor] = []
        made = 0
        for event in order:
            if event == "b":
                acc.backward(losses.pop(0))
                continue
            rows = _rows(made, rank)
            made += 1
            if event == "f":
                with acc.micro_step():
                    losses.append(nn.functional.mse_loss(ddp(x[rows]), y[rows]))
            else:
                losses.append(nn.functional.mse_loss(ddp(x[rows]), y[rows]))
        if acc.pending:
            acc.flush()
    ddp(torch.zeros(2, 6))  # DDP broadcasts rank 0's buffers before a forward after a sync
    ref_params = dict(ref.named_parameters())
    return {
        "diff": max(float((p.detach() - ref_params[n].detach()).abs().max())
                    for n, p in ddp.module.named_parameters()),
        "params": [p.detach().flatten().tolist() for p in ddp.module.parameters()],
        "running_mean": ddp.module[1].running_mean.tolist(),
        "steps": acc.optimizer_steps,
    }


def worker(out_dir: Path) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        result = {name: _run(order, rank) for name, order in ORDERS.items()}
        dist.barrier()
    finally:
        dist.destroy_process_group()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.slow
def test_every_order_of_forwards_and_backwards_trains_like_one_process(tmp_path: Path) -> None:
    from tests.procs import run_torchrun

    proc = run_torchrun(Path(__file__), WORLD, [str(tmp_path)], timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    wrong = {}
    for name in ORDERS:
        got = [res[name] for res in results]
        checks = {
            "steps": all(g["steps"] == WINDOWS for g in got),
            "weights": all(g["diff"] < 1e-6 for g in got),
            "ranks": got[0]["params"] == got[1]["params"],  # one model on every rank
            "buffers": got[0]["running_mean"] == got[1]["running_mean"],
        }
        if not all(checks.values()):
            wrong[name] = (checks, [g["diff"] for g in got])
    assert wrong == {}


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
