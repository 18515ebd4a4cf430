"""Two gloo processes on 127.0.0.1 under torchrun: what does not train leaves the
gradients of a :class:`StagePipeline` alone. After a training ``step()`` (the gradients
a window accumulates), a ``forward()`` -- in training and in evaluation mode, in one or
two schedules of micro-batches -- and the chunk sweep ``choose_stage_chunks`` leave every
``.grad`` exactly as the step made it, for each schedule.

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
CONFIGS = ["gpipe:4", "1f1b:4", "interleaved1f1b:4:2"]  # schedule:chunks[:stages_per_rank]


def _grads(pipe: Any) -> list[Any]:
    return [p.grad.detach().clone() for p in pipe.parameters()]


def _unchanged(before: list[Any], pipe: Any) -> bool:
    import torch

    after = [p.grad for p in pipe.parameters()]
    return len(after) == len(before) > 0 and all(
        b is not None and torch.equal(a, b) for a, b in zip(before, after, strict=True))


def _check(config: str) -> dict[str, Any]:
    from torch import nn

    from torchgpu.parallel.stage_chunks import choose_stage_chunks
    from torchgpu.parallel.stages import StagePipeline
    from torchgpu.parallel.stages_demo import demo_batch, demo_model

    name, chunks, *rest = config.split(":")
    pipe = StagePipeline(demo_model(8, 4, 0), device="cpu", loss_fn=nn.functional.mse_loss,
                         schedule=name, chunks=int(chunks),
                         stages_per_rank=int(rest[0]) if rest else 1)
    x, y = demo_batch(10, 8, 0)  # 10 rows in 4 micro-batches: two schedules
    pipe.step(x, y)
    before = _grads(pipe)
    found: dict[str, Any] = {}
    pipe.forward(x)  # training mode, the configured chunks
    found["forward"] = _unchanged(before, pipe)
    pipe.forward(x, chunks=2)  # another forward-only schedule
    found["forward_chunks_2"] = _unchanged(before, pipe)
    pipe.train(False)
    pipe.forward(x)
    pipe.train(True)
    found["forward_eval"] = _unchanged(before, pipe)
    choose_stage_chunks(pipe, x, y, [2, 4], steps=1, warmup=0)
    found["sweep"] = _unchanged(before, pipe)
    # The step after them adds to the gradients as if nothing had run in between.
    pipe.step(x, y)
    found["step_adds"] = all(
        torch_close(2 * a, p.grad) for a, p in zip(before, pipe.parameters(), strict=True))
    return found


def torch_close(a: Any, b: Any) -> bool:
    import torch

    return b is not None and bool(torch.allclose(a, b, rtol=1e-5, atol=1e-7))


def worker(out_dir: Path) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        result = {config: _check(config) for config in CONFIGS}
        dist.barrier()
    finally:
        dist.destroy_process_group()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.slow
def test_forward_and_sweep_leave_the_gradients_alone(tmp_path: Path) -> None:
    from tests.procs import run_torchrun

    proc = run_torchrun(Path(__file__), WORLD, [str(tmp_path)], timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(WORLD):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for config in CONFIGS:
            assert result[config] == {
                "forward": True, "forward_chunks_2": True, "forward_eval": True,
                "sweep": True, "step_adds": True,
            }, (rank, config)


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
