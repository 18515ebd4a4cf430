"""Worker for test_train_oom_gloo.py: one gloo process group, several DDP scenarios on
run_epoch, where only rank 1 runs out of memory / sees a NaN loss, each with the loss read
per micro-batch (as on the CPU) and then per optimizer step (as on an accelerator). Prints
one JSON line per rank: {"rank": r, "micro-batch": {scenario: ...}, "step": {...}}."""

from __future__ import annotations

import gc
import json
import math
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from torchgpu.accumulate import GradAccumulator
from torchgpu.errors import NonFiniteLossError
from torchgpu.launch.stop_record import StopFlag
from torchgpu.models import HousingNet
from torchgpu.precision import Precision
from torchgpu.train.loop import epoch as loop
from torchgpu.train.loop.backoff import LoopBackoff
from torchgpu.train.loop.epoch import run_epoch
from torchgpu.train.loop.parts import LoopParts
from torchgpu.train.state import TrainState


def batches(rank: int, batch: int, samples: int = 128) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(samples, 13, generator=g), torch.randn(samples, 1, generator=g)
    return list(zip(x.split(batch), y.split(batch), strict=True))


def dropout_net() -> nn.Module:
    return nn.Sequential(nn.Linear(13, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 1))


def setup(batch: int, accumulate: int, *, on_nonfinite: str = "stop", backoff: bool = True,
          loss_fn: Any = None, build: Any = HousingNet) -> tuple[nn.Module, LoopParts]:
    torch.manual_seed(0)
    model = DDP(build())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    precision = Precision("fp32", "cpu")
    acc = GradAccumulator(model, optimizer, accumulate, precision=precision)
    loss = loss_fn or nn.MSELoss()
    lb = (LoopBackoff(model, acc, loss, batch_size=batch, accumulate=accumulate,
                      distributed=True) if backoff else None)
    parts = LoopParts(model=model, loss_fn=loss, accumulator=acc, precision=precision,
                      device=torch.device("cpu"), accumulate=accumulate, rank=dist.get_rank(),
                      agree=True, on_nonfinite=on_nonfinite, backoff=lb)
    return model, parts


def oom_above(limit: int) -> Any:
    def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        if module.training and int(inputs[0].shape[0]) > limit:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated on rank 1)")

    return hook


def weights(model: nn.Module) -> list[float]:
    return [float(v) for p in model.parameters() for v in p.detach().reshape(-1)[:3]]


def same_everywhere(values: list[float]) -> bool:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, values)
    return all(g == gathered[0] for g in gathered)


def backoff_case(batch: int, accumulate: int, limit: int, ref_batch: int,
                 ref_accumulate: int, build: Any = HousingNet) -> dict[str, Any]:
    rank = dist.get_rank()
    model, parts = setup(batch, accumulate, build=build)
    if rank == 1:
        # with dropout: on the last layer, after the dropout drew its mask
        hooked = model.module[3] if build is dropout_net else model.module
        hooked.register_forward_pre_hook(oom_above(limit))
    state = TrainState()
    run_epoch(parts, batches(rank, batch), state, batches_per_epoch=128 // batch)
    reference, ref_parts = setup(ref_batch, ref_accumulate, backoff=False, build=build)
    ref_state = TrainState()
    run_epoch(ref_parts, batches(rank, ref_batch), ref_state, batches_per_epoch=128 // ref_batch)
    assert parts.backoff is not None
    events = parts.backoff.events
    return {
        "pairs": [[e.previous_micro_batch, e.previous_accumulate] for e in events]
        + [[e.micro_batch, e.accumulate] for e in events[-1:]],
        "steps": state.step,
        "equal_to_reference": all(
            torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(),
                                              strict=True)),
        "same_weights_on_all_ranks": same_everywhere(weights(model)),
        "losses_match_reference": state.step_losses == ref_state.step_losses,
        "same_losses_on_all_ranks": same_everywhere(state.step_losses),
    }


class NanOnRank1At:
    def __init__(self, at: int) -> None:
        self.calls, self.at = 0, at

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        loss = nn.functional.mse_loss(out, y)
        bad = dist.get_rank() == 1 and self.calls == self.at
        return loss * float("nan") if bad else loss


def nonfinite_case(mode: str, accumulate: int) -> dict[str, Any]:
    rank = dist.get_rank()
    model, parts = setup(16, accumulate, on_nonfinite=mode, loss_fn=NanOnRank1At(3))
    seen: list[list[float]] = []
    state = TrainState()
    result: dict[str, Any] = {}
    try:
        run_epoch(parts, batches(rank, 16), state, batches_per_epoch=8,
                  on_step=lambda s: seen.append(weights(model)))
    except NonFiniteLossError as error:
        result["error"] = str(error)
        result["weights_unchanged"] = weights(model) == seen[-1]
    result.update(steps=state.step, skipped=state.skipped_steps,
                  finite=all(math.isfinite(v) for v in weights(model)),
                  same_weights_on_all_ranks=same_everywhere(weights(model)),
                  same_losses_on_all_ranks=same_everywhere(state.step_losses))
    return result


def stop_case() -> dict[str, Any]:
    rank = dist.get_rank()
    _, parts = setup(4, 1)
    stop = StopFlag()
    synced: list[list[float]] = []

    def on_step(state: TrainState) -> None:
        if state.step == 2:  # every rank: agree here, the losses become global
            loop.sync_now(parts)
            synced.append(list(state.step_losses))
        if state.step == 3 and rank == 0:  # as a signal would, on one rank only
            stop.set("test")

    state = TrainState()
    totals = run_epoch(parts, batches(rank, 4), state, batches_per_epoch=32, stop=stop,
                       on_step=on_step)
    return {"stopped": totals.stopped, "step": state.step,
            "same_step_on_all_ranks": same_everywhere([float(state.step)]),
            "synced_equal": same_everywhere(synced[0]),
            "same_losses_on_all_ranks": same_everywhere(state.step_losses)}


def cases() -> dict[str, Any]:
    return {
        "backoff_1x": backoff_case(64, 1, 16, 16, 4),
        "backoff_window": backoff_case(32, 2, 8, 8, 8),
        "backoff_dropout": backoff_case(64, 1, 16, 16, 4, build=dropout_net),
        "backoff_dropout_window": backoff_case(32, 2, 8, 8, 8, build=dropout_net),
        "skip": nonfinite_case("skip", 1),
        "skip_window": nonfinite_case("skip", 2),
        "stop": nonfinite_case("stop", 1),
        "stop_flag": stop_case(),
    }


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    report: dict[str, Any] = {"rank": dist.get_rank(), "micro-batch": cases()}
    # What an accelerator does (one read per optimizer step), here on the CPU; in the
    # same processes as the per-micro-batch read above, one start-up for both.
    loop.per_step_optimizer = lambda device, acc: acc.optimizer  # type: ignore[attr-defined]
    report["step"] = cases()
    # One os.write of line + newline: ranks share stdout, and a print() under
    # PYTHONUNBUFFERED writes text and newline separately, so lines could interleave.
    os.write(1, (json.dumps(report) + "\n").encode())
    # Free the DDP models (reference cycles) before the group goes: destroying the group
    # under live DDP reducers aborts the process at exit now and then (gloo, torch 2.13).
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
