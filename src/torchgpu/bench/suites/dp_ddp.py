"""``dp-ddp``: DataParallel vs DistributedDataParallel throughput and per-device memory.

The global batch is fixed; every variant trains it once per sample (one optimizer step):

- ``one process``: the whole batch on one device (the baseline);
- ``DataParallel``: one process scattering the batch over every GPU and gathering the
  outputs and gradients on GPU 0 (the seed's ``nn.DataParallel``) — needs 2+ GPUs;
- ``DDP``: one process per device (GPUs with NCCL; on CPU 2 gloo processes), each with
  ``batch / world`` samples, gradients all-reduced (``torchgpu.wrap_data_parallel``).

All variants are interleaved round by round (the DDP processes wait between samples).
Per-device memory is ``max_memory_allocated`` per GPU over one step — DataParallel's
GPU 0 carries the gathered outputs, so it peaks higher; on CPU the DDP rows report each
process's peak resident memory instead.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchgpu.bench.result import Plot, SuiteResult
from torchgpu.bench.suites.common import gpus, rounds_for, sync_for
from torchgpu.bench.suites.resnet_run import workload
from torchgpu.bench.timer import Measurement, measure_interleaved, pairwise_ratios
from torchgpu.bench.workers import Stats, Step, WorkerGroup

FACTORY = "torchgpu.bench.suites.dp_ddp:build_ddp"
FULL_BATCH, QUICK_BATCH = 64, 32
FULL_IMAGE_PX = 64
ONE = "one process"


def _work(quick: bool, batch: int, device: torch.device) -> tuple[nn.Module, Any, Any]:
    work = workload(quick, batch, FULL_IMAGE_PX, device)
    return work.model, work.inputs, work.labels


def _step(model: nn.Module, x: Any, y: Any) -> Step:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()

    return step


def _max_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB


def build_ddp(rank: int, world_size: int, device: torch.device,
              spec: dict[str, Any]) -> tuple[Step, Stats]:
    """Worker side: this rank's DDP replica and its share of the global batch."""
    from torchgpu.parallel.data import wrap_data_parallel

    model, x, y = _work(bool(spec["quick"]), int(spec["batch"]), device)
    share = int(spec["batch"]) // world_size
    x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
    ddp = wrap_data_parallel(model, "ddp", device=device)
    step = _step(ddp, x, y)

    def stats() -> dict[str, Any]:
        if device.type == "cuda":
            return {"rank": rank, "device": str(device),
                    "peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device))}
        return {"rank": rank, "device": str(device), "max_rss_bytes": _max_rss_bytes()}

    return step, stats


def _peaks(devices: Sequence[torch.device], fn: Callable[[], None]) -> list[int]:
    for d in devices:
        torch.cuda.synchronize(d)
        torch.cuda.reset_peak_memory_stats(d)
    fn()
    for d in devices:
        torch.cuda.synchronize(d)
    return [int(torch.cuda.max_memory_allocated(d)) for d in devices]


def _single_sample(name: str, value: float, unit: str, **extra: Any) -> Measurement:
    return Measurement.from_samples(name, [value], unit=unit, extra=extra)


def run(quick: bool, devices: Sequence[torch.device], out: Path) -> SuiteResult:
    """Interleave one process, DataParallel (2+ GPUs) and DDP; then read memory per device."""
    from torchgpu.parallel.data import wrap_data_parallel

    plan = rounds_for(quick)
    batch = QUICK_BATCH if quick else FULL_BATCH
    cuda = gpus(devices)
    first = cuda[0] if cuda else torch.device("cpu")
    ddp_devices = [str(d) for d in cuda] if len(cuda) >= 2 else ["cpu", "cpu"]
    world = len(ddp_devices)
    notes = [f"global batch {batch} per step ({'MLP' if quick else 'ResNet-50'}); DDP: "
             f"{world} processes x {batch // world} samples."]
    single_model, x, y = _work(quick, batch, first)
    single = _step(single_model, x, y)
    variants: dict[str, Callable[[], float | None]] = {ONE: single}
    dp_name = f"DataParallel {len(cuda)} GPUs"
    dp_step: Step | None = None
    if len(cuda) >= 2:
        dp_model, dx, dy = _work(quick, batch, first)
        dp_step = _step(wrap_data_parallel(dp_model, "dp", batch_size=batch), dx, dy)
        variants[dp_name] = dp_step
    else:
        notes.append("DataParallel rows need 2+ GPUs (it scatters one process's batch over "
                     "GPUs); here DDP runs as 2 gloo CPU processes instead."
                     if not cuda else "DataParallel and multi-GPU DDP need 2+ GPUs; DDP "
                     "runs as 2 gloo CPU processes here.")
    backend = "nccl" if ddp_devices[0].startswith("cuda") else "gloo"
    ddp_name = f"DDP {world} processes ({backend})"
    threads = 1 if backend == "nccl" else max(1, torch.get_num_threads() // world)
    with ExitStack() as stack:
        group = stack.enter_context(WorkerGroup(
            FACTORY, ddp_devices, {"quick": quick, "batch": batch}, threads=threads,
            timeout_s=120.0 if quick else 1800.0))
        variants[ddp_name] = group.run_once
        timed = measure_interleaved(variants, plan.rounds, plan.warmup, sync_for(cuda))
        ranks = group.stats()
    measurements = [m.with_extra(samples_per_s=batch / m.median) for m in timed.values()]
    memory: list[Measurement] = []
    if cuda:
        (peak,) = _peaks([first], single)
        memory.append(_single_sample(f"{ONE} {first}", peak, "bytes", device=str(first)))
    if dp_step is not None:
        for d, peak in zip(cuda, _peaks(cuda, dp_step), strict=True):
            memory.append(_single_sample(f"DataParallel {d}", peak, "bytes", device=str(d)))
        notes.append("DataParallel gathers outputs on GPU 0: compare its peak with the others.")
    for stat in ranks:
        key = "peak_allocated_bytes" if "peak_allocated_bytes" in stat else "max_rss_bytes"
        memory.append(_single_sample(f"DDP rank {stat['rank']} {stat['device']}",
                                     stat[key], "bytes", device=stat["device"], kind=key))
    if not cuda:
        notes.append("CPU memory: DDP rows are each process's peak resident set (torch, model, "
                     "activations); the one-process row has no separate process to measure.")
    by_name = {m.name: m for m in measurements}
    pairs = [(ONE, ddp_name)] + ([(dp_name, ddp_name)] if dp_step is not None else [])
    ratios = pairwise_ratios(by_name, pairs)
    notes.append(f"ratio 'X/{ddp_name}' > 1 means DDP is faster than X (time ratio); "
                 f"threads: one process {torch.get_num_threads()}, each DDP process {threads}.")
    plots = [
        Plot(filename="throughput.png", kind="bar", title=f"training throughput, batch {batch}",
             ylabel="samples/s (from the median step)", names=tuple(by_name),
             value="extra:samples_per_s", best="max"),
        Plot(filename="time.png", kind="bar", title="step time",
             ylabel="seconds per step, median [min..max]", names=tuple(by_name)),
        Plot(filename="memory.png", kind="bar", title="peak memory per device / process",
             ylabel="MiB", names=tuple(m.name for m in memory), scale=1 / 2**20),
    ]
    return SuiteResult(
        suite="dp-ddp", quick=quick,
        devices=tuple(dict.fromkeys([str(first), *ddp_devices])),
        measurements=tuple(measurements + memory), ratios=tuple(ratios), plots=tuple(plots),
        notes=tuple(notes),
        config={"batch": batch, "world_size": world, "backend": backend,
                "rounds": plan.rounds, "warmup": plan.warmup},
    )
