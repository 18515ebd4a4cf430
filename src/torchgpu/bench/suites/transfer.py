"""``transfer``: host<->device bandwidth, pageable vs pinned, blocking vs non_blocking, and
how much of the copy :class:`torchgpu.transfer.Prefetcher` hides behind compute.

On a machine without a GPU the suite measures host memcpy (pageable -> pageable, and
pinned -> pageable when torch can pin, which needs CUDA) and says the GPU rows need a GPU.
Host copies are at least 64 MiB: a few MiB fit in the CPU's caches and would measure cache
bandwidth, not memory. Bandwidth is bytes / time / 1e9 (GB/s, decimal, as PCIe figures
are quoted).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from torchgpu.bench.result import Plot, SuiteResult
from torchgpu.bench.suites.common import gpus, rounds_for, sync_for
from torchgpu.bench.timer import Measurement, Ratio, measure_interleaved, pairwise_ratios
from torchgpu.bench.verdict import find_ratio, rate_verdict

MIB = 2**20
FULL_SIZES_MIB = (4, 64, 256)  # host<->device copies
QUICK_SIZES_MIB = (64,)
HOST_MIN_MIB = 64  # host memcpy below this fits in cache (see the module docstring)


def try_pinned(nbytes: int) -> tuple[torch.Tensor | None, str | None]:
    """A pinned host buffer, or (None, why) where torch cannot pin (no CUDA)."""
    try:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), None
    except RuntimeError as error:
        return None, str(error).splitlines()[0].rstrip(".")


def _copier(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> Callable[[], None]:
    def copy() -> None:
        dst.copy_(src, non_blocking=non_blocking)

    return copy


def gb_per_s(nbytes: int) -> Callable[[float], float]:
    """Seconds per copy of ``nbytes`` -> GB/s (decimal)."""

    def rate(seconds: float) -> float:
        return nbytes / seconds / 1e9 if seconds > 0 else float("inf")

    return rate


def _rates(timed: dict[str, Measurement], nbytes: int, size_mib: int) -> list[Measurement]:
    return [m.derive(gb_per_s(nbytes), unit="GB/s").with_extra(
        size_mib=size_mib, median_time_s=m.median) for m in timed.values()]


def hidden_fractions(serial: Sequence[float], prefetched: Sequence[float],
                     copy_only: Sequence[float]) -> list[float]:
    """Per round, the share of the copy time that overlapping took off the pass:
    ``(serial - prefetched) / copy_only``, clipped to [0, 1] (0 where nothing was copied)."""
    return [
        min(1.0, max(0.0, (s - p) / c)) if c > 0 else 0.0
        for s, p, c in zip(serial, prefetched, copy_only, strict=True)
    ]


def host_rows(size_mib: int, quick: bool) -> tuple[list[Measurement], list[str]]:
    """Host memcpy GB/s: pageable source vs pinned source (when pinning works)."""
    plan = rounds_for(quick)
    nbytes = size_mib * MIB
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    variants = {f"host memcpy pageable {size_mib} MiB": _copier(dst, src, False)}
    notes = []
    pinned, why = try_pinned(nbytes)
    if pinned is None:
        notes.append(f"pinned host memory skipped: torch cannot pin here ({why}); pinning "
                     "needs a CUDA build and driver.")
    else:
        pinned.fill_(1)
        variants[f"host memcpy pinned {size_mib} MiB"] = _copier(dst, pinned, False)
    timed = measure_interleaved(variants, plan.rounds, plan.warmup)
    return _rates(timed, nbytes, size_mib), notes


def gpu_rows(device: torch.device, size_mib: int, quick: bool) -> list[Measurement]:
    """H2D and D2H GB/s on ``device``: pageable vs pinned, blocking vs non_blocking."""
    plan = rounds_for(quick)
    nbytes = size_mib * MIB
    pageable = torch.ones(nbytes, dtype=torch.uint8)
    pinned = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    on_gpu = torch.ones(nbytes, dtype=torch.uint8, device=device)
    tag = f"{device} {size_mib} MiB"
    variants = {
        f"H2D pageable {tag}": _copier(on_gpu, pageable, False),
        f"H2D pinned {tag}": _copier(on_gpu, pinned, False),
        f"H2D pinned non_blocking {tag}": _copier(on_gpu, pinned, True),
        f"D2H pageable {tag}": _copier(pageable, on_gpu, False),
        f"D2H pinned non_blocking {tag}": _copier(pinned, on_gpu, True),
    }
    timed = measure_interleaved(variants, plan.rounds, plan.warmup, sync_for([device]))
    rows = _rates(timed, nbytes, size_mib)
    # How long the host waits for the call to return (the point of non_blocking).
    for name, flag in ((f"H2D pinned {tag}", False), (f"H2D pinned non_blocking {tag}", True)):
        returns = []
        for _ in range(plan.rounds):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            on_gpu.copy_(pinned, non_blocking=flag)
            returns.append(time.perf_counter() - start)
            torch.cuda.synchronize(device)
        index = [r.name for r in rows].index(name)
        rows[index] = rows[index].with_extra(host_return_s=sorted(returns)[len(returns) // 2])
    return rows


def prefetch_names(device: torch.device) -> dict[str, str]:
    """The Prefetcher rows' names on ``device`` (one set per GPU, so names stay unique)."""
    return {"copy": f"copy only {device}", "compute": f"compute only {device}",
            "serial": f"serial copy+compute {device}",
            "prefetched": f"Prefetcher copy+compute {device}",
            "hidden": f"copy hidden by Prefetcher {device}"}


def prefetch_rows(device: torch.device, quick: bool) -> tuple[list[Measurement], list[str]]:
    """Serial copy-then-compute vs :class:`Prefetcher` over the same pinned batches.

    hidden fraction per round = (serial - prefetched) / copy-only, clipped to [0, 1]: the
    share of the copy time that overlapping took off the epoch.
    """
    from torchgpu.transfer import Prefetcher

    plan = rounds_for(quick)
    n_batches, batch_mib = (4, 4) if quick else (16, 64)
    width = 1024
    rows_per_batch = batch_mib * MIB // 4 // width
    batches = [torch.randn(rows_per_batch, width).pin_memory() for _ in range(n_batches)]
    weight = torch.randn(width, width, device=device)
    sync = sync_for([device])
    assert sync is not None

    def compute_once(x: torch.Tensor) -> torch.Tensor:
        return x @ weight

    # Calibrate compute to take about as long as one copy, so there is something to hide.
    def median_time(fn: Callable[[], object]) -> float:
        samples = []
        for _ in range(5):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            samples.append(time.perf_counter() - start)
        return sorted(samples)[2]

    x0 = batches[0].to(device)
    copy_s = median_time(lambda: batches[0].to(device, non_blocking=True))
    matmul_s = median_time(lambda: compute_once(x0))
    reps = max(1, round(copy_s / max(matmul_s, 1e-9)))

    def compute(x: torch.Tensor) -> None:
        for _ in range(reps):
            compute_once(x)

    def copy_only() -> None:
        for b in batches:
            b.to(device, non_blocking=True)

    def compute_only() -> None:
        for _ in batches:
            compute(x0)

    def serial() -> None:
        for b in batches:
            compute(b.to(device))

    def prefetched() -> None:
        for x in Prefetcher(batches, device):
            compute(x)

    names = prefetch_names(device)
    variants = {names["copy"]: copy_only, names["compute"]: compute_only,
                names["serial"]: serial, names["prefetched"]: prefetched}
    timed = measure_interleaved(variants, plan.rounds, plan.warmup, sync)
    hidden = hidden_fractions(timed[names["serial"]].samples,
                              timed[names["prefetched"]].samples,
                              timed[names["copy"]].samples)
    rows = [m.with_extra(batches=n_batches, batch_mib=batch_mib, compute_reps=reps)
            for m in timed.values()]
    rows.append(Measurement.from_samples(names["hidden"], hidden, unit="fraction"))
    return rows, [f"Prefetcher on {device}: {n_batches} pinned batches of {batch_mib} MiB, "
                  "compute calibrated to about one copy's time per batch."]


def run(quick: bool, devices: Sequence[torch.device], out: Path, threads: int) -> SuiteResult:
    """Host memcpy rows always; H2D/D2H and Prefetcher rows on each GPU in ``devices``."""
    sizes = QUICK_SIZES_MIB if quick else FULL_SIZES_MIB
    host_sizes = tuple(s for s in sizes if s >= HOST_MIN_MIB)
    measurements: list[Measurement] = []
    notes: list[str] = [f"host copies of {', '.join(map(str, host_sizes))} MiB: at least "
                        f"{HOST_MIN_MIB} MiB so the copy does not fit in CPU caches."]
    ratios: list[Ratio] = []
    for size in host_sizes:
        rows, why = host_rows(size, quick)
        measurements += rows
        notes += [n for n in why if n not in notes]
        by = {m.name: m for m in rows}
        pinned, pageable = f"host memcpy pinned {size} MiB", f"host memcpy pageable {size} MiB"
        if pinned in by:
            ratios += pairwise_ratios(by, [(pinned, pageable)])
    cuda = gpus(devices)
    for device in cuda:
        for size in sizes:
            rows = gpu_rows(device, size, quick)
            measurements += rows
            by = {m.name: m for m in rows}
            tag = f"{device} {size} MiB"
            ratios += pairwise_ratios(by, [(f"H2D pinned {tag}", f"H2D pageable {tag}"),
                                           (f"D2H pinned non_blocking {tag}",
                                            f"D2H pageable {tag}")])
        rows, why = prefetch_rows(device, quick)
        measurements += rows
        notes += why
    if not cuda:
        notes.append("no GPU among the devices: host<->device rows (H2D/D2H pageable vs "
                     "pinned, non_blocking, Prefetcher overlap) need a CUDA GPU.")
    else:
        notes.append("ratios 'pinned/pageable' are bandwidth ratios (GB/s over GB/s, per "
                     "round): > 1 means pinned is faster. host_return_s: how long the call "
                     "blocked the host.")
    bandwidth = tuple(m.name for m in measurements if m.unit == "GB/s")
    plots = [Plot(filename="bandwidth.png", kind="bar", title="copy bandwidth",
                  ylabel="GB/s, median [min..max]", names=bandwidth, best="max")]
    overlap = tuple(m.name for m in measurements if m.unit == "s")
    if overlap:
        plots.append(Plot(filename="prefetch.png", kind="bar",
                          title="copy/compute overlap (Prefetcher)",
                          ylabel="seconds per pass, median [min..max]", names=overlap))
    return SuiteResult(
        suite="transfer", quick=quick,
        devices=tuple(["cpu", *[str(d) for d in cuda]]),
        measurements=tuple(measurements), ratios=tuple(ratios), plots=tuple(plots),
        notes=tuple(notes),
        config={"sizes_mib": list(sizes), "host_sizes_mib": list(host_sizes),
                "rounds": rounds_for(quick).rounds, "warmup": rounds_for(quick).warmup,
                "threads": threads},
        verdicts=tuple(_verdicts(measurements, ratios, cuda, sizes)),
    )


def _verdicts(measurements: list[Measurement], ratios: list[Ratio],
              cuda: list[torch.device], sizes: Sequence[int]) -> list[str]:
    if not cuda:
        return ["pinned memory gives higher host-to-device bandwidth: not checked here (no "
                "GPU among the devices)."]
    verdicts = []
    largest = max(sizes)
    for device in cuda:
        tag = f"{device} {largest} MiB"
        ratio = find_ratio(ratios, f"H2D pinned {tag}", f"H2D pageable {tag}")
        if ratio is not None:
            verdicts.append(rate_verdict(f"H2D pinned ({tag})", "pageable", ratio, "bandwidth",
                                         seed="pinned is faster; others measured 40-55 GB/s "
                                         "pinned on PCIe Gen5", expect="higher"))
    hidden = [m for d in cuda for m in measurements if m.name == prefetch_names(d)["hidden"]]
    for m in hidden:
        verdicts.append(f"{m.name}: the Prefetcher hides {m.median * 100:.0f}% of the copy "
                        f"time behind compute [{m.min * 100:.0f}% .. {m.max * 100:.0f}%]")
    return verdicts
