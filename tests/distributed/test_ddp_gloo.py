"""Two gloo processes on 127.0.0.1 under torchrun: DDP with accumulation equals the big
batch (all-reduce skipped on non-boundary micro-steps), activation checkpointing under
DDP, FSDP2 on CPU, and the agreement helpers.

This file is both the pytest test and, run as a script by torchrun, the worker: one
launch of 2 processes checks everything; each worker writes its findings to JSON and
the test asserts on them.
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


def _model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))


def _deep_model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(9):
        layers += [nn.Linear(16, 16), nn.ReLU(), nn.Dropout(0.2)]
    return nn.Sequential(*layers, nn.Linear(16, 1))


def _data(rows: int, seed: int) -> Any:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 6, generator=gen), torch.randn(rows, 1, generator=gen)


def _max_diff(a: Any, b: Any) -> float:
    return max(
        float((p.detach() - q.detach()).abs().max())
        for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


def _check_accumulation(opt_name: str, rank: int) -> dict[str, Any]:
    """2 full windows of K micro-steps, then a partial window of 2 and flush(), under DDP,
    against one process training the plain model on each window's global batch."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from torchgpu.accumulate import GradAccumulator
    from torchgpu.parallel.data import wrap_data_parallel

    def make_opt(m: Any) -> Any:
        if opt_name == "adam":
            return torch.optim.Adam(m.parameters(), lr=1e-2)
        return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    windows = [(K, _data(WORLD * K * MICRO, seed)) for seed in (1, 2)]
    windows.append((2, _data(WORLD * 2 * MICRO, 3)))  # a partial window, for flush()
    ref = _model()
    ref_opt = make_opt(ref)
    for _, (x, y) in windows:
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()

    ddp = wrap_data_parallel(_model(), "ddp")
    calls = {"n": 0}

    # Unannotated: DDP checks hook annotations at run time (see test_accumulate).
    def counting_allreduce(state, bucket):  # type: ignore[no-untyped-def]
        state["n"] += 1
        return default_hooks.allreduce_hook(dist.group.WORLD, bucket)

    ddp.register_comm_hook(calls, counting_allreduce)
    acc = GradAccumulator(ddp, make_opt(ddp), steps=K)
    stepped = []
    for micro_steps, (x, y) in windows:
        for i in range(micro_steps):
            rows = slice((i * WORLD + rank) * MICRO, (i * WORLD + rank + 1) * MICRO)
            with acc.micro_step():  # rows: this rank's share of micro-step i
                loss = nn.functional.mse_loss(ddp(x[rows]), y[rows])
                stepped.append(acc.backward(loss))
    hooks_before_flush = calls["n"]
    flushed = acc.flush()
    return {
        "max_diff": _max_diff(ref, ddp.module),
        "moved": _max_diff(_model(), ddp.module),
        "stepped": stepped,
        "flushed": flushed,
        "allreduce_calls": hooks_before_flush,
        "micro_steps": sum(m for m, _ in windows),
    }


def _check_checkpointing_under_ddp() -> dict[str, Any]:
    import torch

    from torchgpu.memory.activation_checkpointing import apply_activation_checkpointing
    from torchgpu.parallel.data import wrap_data_parallel

    plain = wrap_data_parallel(_deep_model(), "ddp")
    ckpt = wrap_data_parallel(apply_activation_checkpointing(_deep_model()), "ddp")
    rank = torch.distributed.get_rank()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 + rank))
    grads = []
    for model in (plain, ckpt):
        torch.manual_seed(5 + rank)
        model(x).square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    return {
        "bitwise_equal": all(torch.equal(a, b) for a, b in zip(*grads, strict=True)),
        "same_keys": list(plain.module.state_dict()) == list(ckpt.module.state_dict()),
        "grad_sum": float(sum(g.abs().sum() for g in grads[1])),
    }


def _check_fsdp(rank: int) -> dict[str, Any]:
    """FSDP2 on CPU with accumulation (2 micro-steps per window) against the big batch."""
    try:
        import torch
        from torch import nn

        from torchgpu.accumulate import GradAccumulator
        from torchgpu.parallel.data import wrap_data_parallel

        x, y = _data(WORLD * 2 * MICRO, 4)
        ref = _model()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()

        model = wrap_data_parallel(_model(), "fsdp")
        acc = GradAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2)
        for i in range(2):
            rows = slice((i * WORLD + rank) * MICRO, (i * WORLD + rank + 1) * MICRO)
            with acc.micro_step():
                acc.backward(nn.functional.mse_loss(model(x[rows]), y[rows]))
        full = [p.full_tensor() for p in model.parameters()]
        diff = max(
            float((a - b.detach()).abs().max())
            for a, b in zip(full, ref.parameters(), strict=True)
        )
        return {"max_diff": diff, "keys": list(model.state_dict()), "error": None}
    except Exception as exc:  # reported, not hidden: the test prints it
        return {"error": f"{type(exc).__name__}: {exc}"}


def worker(out_dir: Path) -> None:
    import torch
    import torch.distributed as dist

    from torchgpu.collectives import agree_any, agree_max, agree_min, broadcast_object
    from torchgpu.distributed import init_distributed

    torch.set_num_threads(1)
    result: dict[str, Any] = {}
    with init_distributed(device="cpu") as env:
        rank = env.rank
        result["env"] = [env.rank, env.local_rank, env.world_size, env.backend]
        result["agree_any"] = agree_any(rank == 1)
        result["agree_none"] = agree_any(False)
        result["agree_min"] = agree_min(rank + 5)
        result["agree_max"] = agree_max(rank + 5)
        result["broadcast"] = broadcast_object({"from": rank})
        result["accumulate"] = {name: _check_accumulation(name, rank) for name in ("sgd", "adam")}
        result["checkpointing"] = _check_checkpointing_under_ddp()
        result["fsdp"] = _check_fsdp(rank)
        dist.barrier()
    result["destroyed"] = not dist.is_initialized()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.slow
def test_two_gloo_processes(tmp_path: Path) -> None:
    from tests.procs import run_torchrun

    proc = run_torchrun(Path(__file__), WORLD, [str(tmp_path)], timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for rank, res in enumerate(results):
        assert res["env"] == [rank, rank, WORLD, "gloo"]
        assert res["agree_any"] is True and res["agree_none"] is False
        assert (res["agree_min"], res["agree_max"]) == (5, 6)
        assert res["broadcast"] == {"from": 0}
        assert res["destroyed"] is True
        for name, acc in res["accumulate"].items():
            assert acc["max_diff"] < 1e-6, (name, acc)
            assert acc["moved"] > 1e-3, (name, acc)  # training happened
            assert acc["stepped"] == [False, False, True] * 2 + [False, False], (name, acc)
            assert acc["flushed"] is True
            # one all-reduce per closed window: none for the 6 no_sync micro-steps
            assert acc["allreduce_calls"] == 2, (name, acc)
            assert acc["micro_steps"] == 8
        ckpt = res["checkpointing"]
        assert ckpt["bitwise_equal"] and ckpt["same_keys"] and ckpt["grad_sum"] > 0
        fsdp = res["fsdp"]
        assert fsdp["error"] is None, fsdp["error"]
        assert fsdp["max_diff"] < 1e-6
        assert fsdp["keys"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    # DDP keeps replicas identical: both ranks see the same (reduced) result
    assert results[0]["accumulate"] == results[1]["accumulate"]


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
