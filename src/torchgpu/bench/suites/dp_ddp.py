"""``dp-ddp``: DataParallel vs DistributedDataParallel throughput and per-device memory.

The global batch is fixed; every variant trains it once per sample (one optimizer step).
Every comparison is like with like:

- 2+ GPUs: ``one process`` (the whole batch on GPU 0), ``DataParallel`` (one process
  scattering the batch over every GPU and gathering outputs and gradients on GPU 0, the
  seed's ``nn.DataParallel``) and ``DDP`` (one NCCL process per GPU, ``batch / world``
  samples each), interleaved. Memory: ``max_memory_allocated`` per GPU over one step —
  DataParallel's GPU 0 carries the gathered outputs, so it peaks higher.
- otherwise (CPU, or a single GPU, where neither DataParallel nor multi-GPU DDP exists):
  ``one process`` and ``DDP`` over 2 gloo processes, all on the CPU, each in its own
  worker process(es) timed between barriers. Memory: each process's peak resident set.

GPU bytes (allocated by the caching allocator) and CPU bytes (resident set of a whole
process) are different measures; a run has one kind only, and its chart says which.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from torchgpu.bench.result import Plot, SuiteResult
from torchgpu.bench.suites.common import gpus, rounds_for, sync_for
from torchgpu.bench.suites.resnet_run import workload
from torchgpu.bench.timer import Measurement, Ratio, measure_interleaved, pairwise_ratios
from torchgpu.bench.verdict import find_ratio, time_verdict
from torchgpu.bench.workers import Stats, Step, WorkerGroup

DDP_FACTORY = "torchgpu.bench.suites.dp_ddp:build_ddp"
ONE_FACTORY = "torchgpu.bench.suites.dp_ddp:build_one"
FULL_BATCH, QUICK_BATCH = 64, 32
FULL_IMAGE_PX = 64
ONE = "one process"
ALLOCATED, RSS = "peak_allocated_bytes", "max_rss_bytes"


@dataclass(frozen=True)
class DdpPlan:
    """Where each variant runs, decided from the GPUs alone (pure, so it is tested on CPU).

    ``kind`` "gpu": one process and DataParallel in this process on ``one_device``, DDP
    over ``ddp_devices`` (NCCL). "cpu": one process and DDP in gloo worker processes.
    """

    kind: str
    one_device: str
    ddp_devices: tuple[str, ...]
    data_parallel: bool
    memory_key: str
    reason: str

    @property
    def backend(self) -> str:
        return "nccl" if self.kind == "gpu" else "gloo"

    @property
    def ddp_name(self) -> str:
        return f"DDP {len(self.ddp_devices)} processes ({self.backend})"


def plan_for(cuda: Sequence[torch.device]) -> DdpPlan:
    """The like-for-like layout for these GPUs (see the module docstring)."""
    if len(cuda) >= 2:
        return DdpPlan("gpu", str(cuda[0]), tuple(str(d) for d in cuda), True, ALLOCATED,
                       f"{len(cuda)} GPUs: one process on {cuda[0]}, DataParallel and DDP "
                       "over every GPU")
    why = ("one GPU: DataParallel and multi-GPU DDP need 2+ GPUs, so the comparison runs on "
           "the CPU (one process vs 2 gloo processes); the GPU is not used"
           if cuda else "no GPU: one process vs DDP over 2 gloo CPU processes; DataParallel "
           "rows need 2+ GPUs")
    return DdpPlan("cpu", "cpu", ("cpu", "cpu"), False, RSS, why)


def _work(quick: bool, batch: int, device: torch.device) -> tuple[nn.Module, Tensor, Tensor]:
    work = workload(quick, batch, FULL_IMAGE_PX, device)
    return work.model, work.inputs, work.labels


def _step(model: nn.Module, x: Tensor, y: Tensor) -> Step:
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


def _stats(rank: int, device: torch.device) -> Stats:
    def stats() -> dict[str, Any]:
        if device.type == "cuda":
            return {"rank": rank, "device": str(device),
                    ALLOCATED: int(torch.cuda.max_memory_allocated(device))}
        return {"rank": rank, "device": str(device), RSS: _max_rss_bytes()}

    return stats


def build_ddp(rank: int, world_size: int, device: torch.device,
              spec: dict[str, Any]) -> tuple[Step, Stats]:
    """Worker side: this rank's DDP replica and its share of the global batch."""
    from torchgpu.parallel.data import wrap_data_parallel

    model, x, y = _work(bool(spec["quick"]), int(spec["batch"]), device)
    share = int(spec["batch"]) // world_size
    x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
    ddp = wrap_data_parallel(model, "ddp", device=device)
    return _step(ddp, x, y), _stats(rank, device)


def build_one(rank: int, world_size: int, device: torch.device,
              spec: dict[str, Any]) -> tuple[Step, Stats]:
    """Worker side: the one-process baseline, the whole batch, a plain model. Run in its
    own process so its resident set is measured exactly like a DDP rank's."""
    model, x, y = _work(bool(spec["quick"]), int(spec["batch"]), device)
    return _step(model, x, y), _stats(rank, device)


def _peaks(devices: Sequence[torch.device], fn: Callable[[], None]) -> list[int]:
    for d in devices:
        torch.cuda.synchronize(d)
        torch.cuda.reset_peak_memory_stats(d)
    fn()
    for d in devices:
        torch.cuda.synchronize(d)
    return [int(torch.cuda.max_memory_allocated(d)) for d in devices]


def _single_sample(name: str, value: float, unit: str, **extra: object) -> Measurement:
    return Measurement.from_samples(name, [value], unit=unit, extra=extra)


def _memory_rows(prefix: str, stats: list[dict[str, Any]], key: str) -> list[Measurement]:
    return [_single_sample(f"{prefix} rank {s['rank']} {s['device']}" if len(stats) > 1
                           else f"{prefix} {s['device']}", s[key], "bytes",
                           device=s["device"], kind=key) for s in stats]


def run(quick: bool, devices: Sequence[torch.device], out: Path, threads: int) -> SuiteResult:
    """Interleave one process, DataParallel (2+ GPUs) and DDP; then read memory per device."""
    from torchgpu.parallel.data import wrap_data_parallel

    plan_rounds = rounds_for(quick)
    batch = QUICK_BATCH if quick else FULL_BATCH
    plan = plan_for(gpus(devices))
    world = len(plan.ddp_devices)
    spec = {"quick": quick, "batch": batch}
    timeout_s = 120.0 if quick else 1800.0
    notes = [plan.reason + ".",
             f"global batch {batch} per step ({'MLP' if quick else 'ResNet-50'}); DDP: "
             f"{world} processes x {batch // world} samples."]
    variants: dict[str, Callable[[], float | None]] = {}
    worker_rows: dict[str, int] = {}  # variant -> processes
    memory: list[Measurement] = []
    dp_name = f"DataParallel {world} GPUs"
    dp_step: Step | None = None
    single: Step | None = None
    with ExitStack() as stack:
        ddp = stack.enter_context(WorkerGroup(DDP_FACTORY, list(plan.ddp_devices), spec,
                                              threads=threads, timeout_s=timeout_s))
        one_group = None
        if plan.kind == "gpu":
            cuda = [torch.device(d) for d in plan.ddp_devices]
            single = _step(*_work(quick, batch, cuda[0]))
            variants[ONE] = single
            dp_model, dx, dy = _work(quick, batch, cuda[0])
            dp_step = _step(wrap_data_parallel(dp_model, "dp", batch_size=batch), dx, dy)
            variants[dp_name] = dp_step
        else:
            cuda = []
            one_group = stack.enter_context(WorkerGroup(ONE_FACTORY, ["cpu"], spec,
                                                        threads=threads, timeout_s=timeout_s))
            variants[ONE] = one_group.run_once
            worker_rows[ONE] = 1
        variants[plan.ddp_name] = ddp.run_once
        worker_rows[plan.ddp_name] = world
        timed = measure_interleaved(variants, plan_rounds.rounds, plan_rounds.warmup,
                                    sync_for(cuda),
                                    threads={name: threads for name in worker_rows})
        if one_group is not None:
            memory += _memory_rows(ONE, one_group.stats(), plan.memory_key)
        elif single is not None:
            (peak,) = _peaks(cuda[:1], single)
            memory.append(_single_sample(f"{ONE} {cuda[0]}", peak, "bytes",
                                         device=str(cuda[0]), kind=ALLOCATED))
        if dp_step is not None:
            for d, peak in zip(cuda, _peaks(cuda, dp_step), strict=True):
                memory.append(_single_sample(f"DataParallel {d}", peak, "bytes",
                                             device=str(d), kind=ALLOCATED))
        memory += _memory_rows("DDP", ddp.stats(), plan.memory_key)
    steps = [m.with_extra(samples_per_s=batch / m.median, processes=worker_rows.get(n, 1),
                          in_worker=n in worker_rows)
             for n, m in timed.items()]
    throughput = [m.derive(lambda s: batch / s if s > 0 else float("inf"), "samples/s",
                           name=f"{m.name} throughput") for m in steps]
    by_name = {m.name: m for m in steps}
    pairs = [(plan.ddp_name, ONE)] + ([(plan.ddp_name, dp_name)] if dp_step else [])
    ratios = pairwise_ratios(by_name, pairs)
    notes += [
        f"ratios '{plan.ddp_name}/X' are time ratios per round: < 1 means DDP is faster "
        "than X.",
        f"thread budget: {threads} thread(s) per process everywhere; '{ONE}' 1 process, "
        f"'{plan.ddp_name}' {world} processes ({world * threads} threads in all)"
        + (f", '{dp_name}' 1 process" if dp_step else "") + ".",
    ]
    if dp_step is not None:
        notes.append("DataParallel gathers outputs on GPU 0: compare its peak with the others.")
    return SuiteResult(
        suite="dp-ddp", quick=quick,
        devices=tuple(dict.fromkeys([plan.one_device, *plan.ddp_devices])),
        measurements=tuple(steps + throughput + memory), ratios=tuple(ratios),
        plots=tuple(_plots(batch, steps, throughput, memory, plan)), notes=tuple(notes),
        config={"batch": batch, "world_size": world, "backend": plan.backend,
                "layout": plan.kind, "rounds": plan_rounds.rounds,
                "warmup": plan_rounds.warmup, "threads": threads,
                "memory": plan.memory_key},
        verdicts=tuple(_verdicts(ratios, plan, dp_name, memory)),
    )


def _plots(batch: int, steps: list[Measurement], throughput: list[Measurement],
           memory: list[Measurement], plan: DdpPlan) -> list[Plot]:
    what = ("peak allocated per GPU (max_memory_allocated), MiB" if plan.memory_key == ALLOCATED
            else "peak resident set per process (ru_maxrss), MiB")
    return [
        Plot(filename="throughput.png", kind="bar", title=f"training throughput, batch {batch}",
             ylabel="samples/s, median [min..max]", names=tuple(m.name for m in throughput),
             labels=tuple(m.name.removesuffix(" throughput") for m in throughput),
             best="max"),
        Plot(filename="time.png", kind="bar", title="step time",
             ylabel="seconds per step, median [min..max]", names=tuple(m.name for m in steps)),
        Plot(filename="memory.png", kind="bar",
             title="peak GPU memory per device" if plan.memory_key == ALLOCATED
             else "peak CPU memory per process",
             ylabel=what, names=tuple(m.name for m in memory), scale=1 / 2**20),
    ]


def _verdicts(ratios: list[Ratio], plan: DdpPlan, dp_name: str,
              memory: list[Measurement]) -> list[str]:
    verdicts = []
    vs_dp = find_ratio(ratios, plan.ddp_name, dp_name)
    if vs_dp is not None:
        verdicts.append(time_verdict(plan.ddp_name, dp_name, vs_dp,
                                     seed="DDP beats DataParallel", expect="faster"))
    else:
        verdicts.append("DDP beats DataParallel: not checked here (DataParallel needs 2+ GPUs).")
    vs_one = find_ratio(ratios, plan.ddp_name, ONE)
    if vs_one is not None:
        verdicts.append(time_verdict(plan.ddp_name, f"{ONE} ({plan.one_device})", vs_one))
    dp_rows = [m for m in memory if m.name.startswith("DataParallel ")]
    if len(dp_rows) >= 2:
        first, rest = dp_rows[0].median, max(m.median for m in dp_rows[1:])
        holds = "holds" if first > rest else "does not hold here"
        verdicts.append(f"DataParallel loads GPU 0 most: GPU 0 peaks at {first / rest:.2f}x "
                        f"the busiest other GPU: claim {holds}")
    return verdicts
