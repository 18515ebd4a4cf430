"""One-line verdicts on the seeds' claims, from per-round ratios.

A verdict reads like "model parallel vs single device: 1.05x slower [1.01x .. 1.09x]
(seed: 1.07x slower)". When the suite knows which way the claim goes (``expect``), it
ends with "holds", "does not hold here" or "unclear": unclear when the rounds disagree
(the per-round [min..max] spans 1), so one lucky round never decides a claim.
"""

from __future__ import annotations

import statistics
from typing import Literal

from torchgpu.bench.timer import Ratio

Direction = Literal["faster", "slower", "higher", "lower"]


def time_factor(ratio: float) -> str:
    """A time ratio ``a/b`` in words: ``1.05x slower`` (a took longer) or ``1.32x faster``."""
    if ratio >= 1:
        return f"{ratio:.2f}x slower"
    return f"{1 / ratio:.2f}x faster" if ratio > 0 else "infinitely faster"


def _outcome(ratio: Ratio, expect: Direction, bigger_is: Direction) -> str:
    """Whether the rounds agree with ``expect``; ``bigger_is`` names what a ratio > 1 means."""
    above = ratio.min > 1
    below = ratio.max < 1
    if not above and not below:
        return "unclear (the rounds disagree)"
    wanted_above = expect == bigger_is
    return "holds" if above == wanted_above else "does not hold here"


def time_verdict(
    subject: str,
    baseline: str,
    ratio: Ratio,
    *,
    seed: str | None = None,
    expect: Literal["faster", "slower"] | None = None,
) -> str:
    """Verdict for a time ratio ``subject_time / baseline_time`` (per round)."""
    text = (f"{subject} vs {baseline}: {time_factor(ratio.median)} "
            f"[{time_factor(ratio.min)} .. {time_factor(ratio.max)}]")
    return _finish(text, ratio, seed, expect, bigger_is="slower")


def rate_verdict(
    subject: str,
    baseline: str,
    ratio: Ratio,
    noun: str,
    *,
    seed: str | None = None,
    expect: Literal["higher", "lower"] | None = None,
) -> str:
    """Verdict for a rate ratio ``subject_rate / baseline_rate`` (per round), e.g.
    "pinned vs pageable H2D: 2.30x the bandwidth [2.1x .. 2.4x]"."""
    text = (f"{subject} vs {baseline}: {ratio.median:.2f}x the {noun} "
            f"[{ratio.min:.2f}x .. {ratio.max:.2f}x]")
    return _finish(text, ratio, seed, expect, bigger_is="higher")


def value_verdict(subject: str, baseline: str, value: float, base: float, noun: str) -> str:
    """Verdict for one deterministic figure (bytes): "2 segments vs none: 0.55x the ..."."""
    if base <= 0:
        return f"{subject} vs {baseline}: {noun} not comparable (baseline is {base:g})"
    return f"{subject} vs {baseline}: {value / base:.2f}x the {noun}"


def _finish(text: str, ratio: Ratio, seed: str | None, expect: Direction | None,
            bigger_is: Direction) -> str:
    if seed:
        text += f" (seed: {seed})"
    if expect is not None:
        text += f": claim {_outcome(ratio, expect, bigger_is)}"
    return text


def inverted(ratio: Ratio) -> Ratio:
    """``denominator/numerator`` from ``numerator/denominator``, round by round."""
    samples = tuple(1 / x if x != 0 else float("inf") for x in ratio.samples)
    return Ratio(ratio.denominator, ratio.numerator, samples, statistics.median(samples),
                 min(samples), max(samples))


def find_ratio(ratios: list[Ratio] | tuple[Ratio, ...], numerator: str,
               denominator: str) -> Ratio | None:
    """The ratio ``numerator/denominator`` among ``ratios``, if measured."""
    for ratio in ratios:
        if ratio.numerator == numerator and ratio.denominator == denominator:
            return ratio
    return None
