"""The measuring core: warm-up, interleaved rounds, medians with [min..max], paired ratios.

Honest timing on a shared, noisy machine needs four things, all here:

* warm-up calls before any sample, so allocator, autotuner and cache effects are paid once;
* a synchronise around every sample on accelerators (CUDA work is asynchronous: without it
  the host clock measures kernel *launches*, not the work). Work spread over two GPUs
  (model parallel, pipelines) must be waited for on both, which is why this synchronises
  devices rather than timing CUDA events on one stream;
* variants interleaved round by round, in a shuffled (seeded) order per round, so slow drift
  and bursts of contention hit every variant alike instead of whichever ran last;
* ratios taken pair by pair within a round (both samples saw the same machine state), then
  summarised by their median.

CPU pressure, read around a run, lives in :mod:`torchgpu.bench.pressure`.

Nothing here touches CUDA unless a caller passes a CUDA device.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

Clock = Callable[[], float]


@dataclass(frozen=True)
class Measurement:
    """Repeated samples of one variant, with their summary.

    ``samples`` are in ``unit`` (seconds for timings), in round order: sample ``i`` of every
    variant measured by the same :func:`measure_interleaved` call comes from round ``i``, which
    is what :func:`pairwise_ratios` relies on. ``threads`` is torch's intra-op thread count in
    the measuring process. ``extra`` holds suite-specific JSON-safe values (bytes, sizes...).
    """

    name: str
    samples: tuple[float, ...]
    median: float
    min: float
    max: float
    mean: float
    stdev: float
    unit: str = "s"
    n: int = 0
    threads: int = 1
    extra: dict[str, Any] = field(default_factory=dict)  # figures the suites read back

    @classmethod
    def from_samples(
        cls,
        name: str,
        samples: Sequence[float],
        unit: str = "s",
        threads: int | None = None,
        extra: Mapping[str, object] | None = None,
    ) -> Measurement:
        """Summarise ``samples`` (at least one). ``threads`` defaults to torch's current count."""
        values = tuple(float(s) for s in samples)
        if not values:
            raise ValueError(f"measurement {name!r} has no samples: measure at least one round")
        return cls(
            name=name,
            samples=values,
            median=statistics.median(values),
            min=min(values),
            max=max(values),
            mean=statistics.fmean(values),
            stdev=statistics.stdev(values) if len(values) > 1 else 0.0,
            unit=unit,
            n=len(values),
            threads=torch.get_num_threads() if threads is None else threads,
            extra=dict(extra or {}),
        )

    def derive(
        self, fn: Callable[[float], float], unit: str, name: str | None = None
    ) -> Measurement:
        """A new measurement with ``fn`` applied to every sample (e.g. seconds -> GB/s).

        The summary is recomputed from the transformed samples, so a decreasing ``fn``
        (rates) gets its min and max right, and round order is kept.
        """
        return Measurement.from_samples(
            name or self.name,
            [fn(s) for s in self.samples],
            unit=unit,
            threads=self.threads,
            extra=self.extra,
        )

    def with_extra(self, **values: object) -> Measurement:
        """A copy with ``values`` merged into ``extra``."""
        return Measurement(**{**self.__dict__, "extra": {**self.extra, **values}})

    def with_threads(self, threads: int) -> Measurement:
        """A copy recording ``threads`` (e.g. the worker processes' count, not the parent's)."""
        return Measurement(**{**self.__dict__, "threads": threads})

    def to_json(self) -> dict[str, object]:
        """A JSON-safe dict; :meth:`from_json` inverts it."""
        return {
            "name": self.name,
            "unit": self.unit,
            "n": self.n,
            "median": self.median,
            "min": self.min,
            "max": self.max,
            "mean": self.mean,
            "stdev": self.stdev,
            "threads": self.threads,
            "samples": list(self.samples),
            "extra": self.extra,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Measurement:
        """Rebuild a measurement written by :meth:`to_json`."""
        return cls(
            name=str(data["name"]),
            samples=tuple(float(s) for s in data["samples"]),
            median=float(data["median"]),
            min=float(data["min"]),
            max=float(data["max"]),
            mean=float(data["mean"]),
            stdev=float(data["stdev"]),
            unit=str(data.get("unit", "s")),
            n=int(data["n"]),
            threads=int(data.get("threads", 1)),
            extra=dict(data.get("extra", {})),
        )


@dataclass(frozen=True)
class Ratio:
    """``numerator / denominator`` per round, summarised.

    For timings, a ratio above 1 means the numerator variant took longer; ``median`` is the
    median of the per-round ratios, not the ratio of the medians.
    """

    numerator: str
    denominator: str
    samples: tuple[float, ...]
    median: float
    min: float
    max: float

    @property
    def name(self) -> str:
        return f"{self.numerator}/{self.denominator}"

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "numerator": self.numerator,
            "denominator": self.denominator,
            "median": self.median,
            "min": self.min,
            "max": self.max,
            "samples": list(self.samples),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Ratio:
        return cls(
            numerator=str(data["numerator"]),
            denominator=str(data["denominator"]),
            samples=tuple(float(s) for s in data["samples"]),
            median=float(data["median"]),
            min=float(data["min"]),
            max=float(data["max"]),
        )


def round_orders(names: Sequence[str], rounds: int, seed: int = 0) -> list[list[str]]:
    """The order variants run in for each round: a fresh seeded shuffle per round."""
    rng = random.Random(seed)
    orders = []
    for _ in range(rounds):
        order = list(names)
        rng.shuffle(order)
        orders.append(order)
    return orders


def measure_interleaved(
    variants: Mapping[str, Callable[[], float | None]],
    rounds: int,
    warmup: int,
    sync: Callable[[], None] | None = None,
    *,
    seed: int = 0,
    clock: Clock = time.perf_counter,
    threads: int | Mapping[str, int] | None = None,
) -> dict[str, Measurement]:
    """Time every variant ``rounds`` times, interleaved, after ``warmup`` untimed calls each.

    Each round runs all variants once in a seeded random order (:func:`round_orders`).
    ``sync`` (e.g. :func:`cuda_sync`) is called right before starting and right before
    stopping the clock, so asynchronous device work is inside the sample. A variant that
    returns a number has timed itself (e.g. inside worker processes, between barriers):
    that number of seconds is its sample instead of the clock's reading. Returns one
    :class:`Measurement` (seconds) per variant, in the order of ``variants``.

    ``threads`` is recorded in each measurement: one count for all, a mapping for
    variants that run elsewhere (worker processes; unnamed variants get this process's
    count), or None for torch's current count in this process.
    """
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: need at least 1 measured round")
    if warmup < 0:
        raise ValueError(f"warmup={warmup}: must be 0 or more")
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    if sync is not None:
        sync()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for order in round_orders(names, rounds, seed):
        for name in order:
            if sync is not None:
                sync()
            start = clock()
            own = variants[name]()
            if sync is not None:
                sync()
            elapsed = clock() - start
            samples[name].append(float(own) if own is not None else elapsed)
    own_threads = torch.get_num_threads()
    per_variant: dict[str, int] = (
        {name: threads.get(name, own_threads) for name in names}
        if isinstance(threads, Mapping)
        else {name: own_threads if threads is None else threads for name in names}
    )
    return {
        name: Measurement.from_samples(name, samples[name], unit="s", threads=per_variant[name])
        for name in names
    }


def pairwise_ratios(
    measurements: Mapping[str, Measurement],
    pairs: Sequence[tuple[str, str]],
) -> list[Ratio]:
    """For each ``(numerator, denominator)`` pair, the per-round ratios and their median.

    Both measurements must come from the same interleaved run (same number of rounds);
    the ratio of round ``i`` uses sample ``i`` of each.
    """
    ratios = []
    for num, den in pairs:
        if num not in measurements or den not in measurements:
            missing = [n for n in (num, den) if n not in measurements]
            raise KeyError(f"ratio {num}/{den}: no measurement named {', '.join(missing)}")
        a, b = measurements[num].samples, measurements[den].samples
        if len(a) != len(b):
            raise ValueError(
                f"ratio {num}/{den}: {len(a)} vs {len(b)} samples; pair only measurements "
                "from the same interleaved run"
            )
        per_round = tuple(x / y if y > 0 else math.inf for x, y in zip(a, b, strict=True))
        ratios.append(
            Ratio(num, den, per_round, statistics.median(per_round), min(per_round),
                  max(per_round))
        )
    return ratios


def rate_ratios(
    timed: Mapping[str, Measurement],
    work: Mapping[str, float],
    pairs: Sequence[tuple[str, str]],
) -> list[Ratio]:
    """Per round, the numerator's rate over the denominator's: ``(w_n / t_n) / (w_d / t_d)``.

    ``timed`` holds seconds per sample; ``work[name]`` is what one sample of ``name`` does
    (FLOPs, bytes, samples). Use this, not :func:`pairwise_ratios` on the seconds, when the
    variants do different amounts of work per sample (e.g. a small product repeated more
    times on a GPU than on the CPU): > 1 means the numerator gets more work done per second.
    """
    names = list(dict.fromkeys(name for pair in pairs for name in pair))
    missing = [name for name in names if name not in work]
    if missing:
        raise KeyError(f"rate ratio: no work given for {', '.join(missing)}")
    rates = {
        name: timed[name].derive(_per_second(work[name]), unit="work/s")
        for name in names
        if name in timed
    }
    return pairwise_ratios(rates, pairs)


def _per_second(work: float) -> Callable[[float], float]:
    def rate(seconds: float) -> float:
        return work / seconds if seconds > 0 else math.inf

    return rate


def cuda_sync(devices: Sequence[torch.device]) -> Callable[[], None]:
    """A ``sync`` that waits for every CUDA device in ``devices`` (no-op for CPU devices).

    Work split over two GPUs (model parallel, pipelines) must be waited for on both, which is
    why this synchronises devices rather than recording events on one stream.
    """
    indices = sorted({d.index or 0 for d in devices if d.type == "cuda"})
    if not indices:
        return _no_sync

    def sync() -> None:
        for index in indices:
            torch.cuda.synchronize(index)

    return sync


def _no_sync() -> None:
    return None
