"""The measuring core, tested with fake clocks: no assertion depends on real elapsed time."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from torchgpu.bench.result import Plot, SuiteResult, best_index, plot_value
from torchgpu.bench.timer import (
    Measurement,
    PressureMonitor,
    dumps,
    measure_interleaved,
    pairwise_ratios,
    parse_pressure,
    round_orders,
)

SAMPLE_PSI = """some avg10=7.74 avg60=6.95 avg300=2.20 total=8300434
full avg10=0.00 avg60=0.00 avg300=0.00 total=0
"""


class FakeClock:
    """A clock that only moves when a fake variant 'works'."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_variants(clock: FakeClock, durations: dict[str, list[float]], log: list[str]):
    """Variants that advance the clock by their next scripted duration and log each call."""
    iters = {name: iter(values) for name, values in durations.items()}

    def make(name: str):
        def run() -> None:
            log.append(name)
            clock.now += next(iters[name])

        return run

    return {name: make(name) for name in durations}


def test_round_orders_are_seeded_permutations_that_vary() -> None:
    names = ["a", "b", "c", "d"]
    orders = round_orders(names, rounds=20, seed=3)
    assert all(sorted(o) == names for o in orders)
    assert len({tuple(o) for o in orders}) > 1  # not the same order every round
    assert orders == round_orders(names, rounds=20, seed=3)
    assert orders != round_orders(names, rounds=20, seed=4)


def test_measure_interleaved_runs_warmup_then_rounds_in_shuffled_order() -> None:
    clock = FakeClock()
    log: list[str] = []
    warmup, rounds = 2, 5
    durations = {
        "a": [100.0] * warmup + [1.0, 1.0, 5.0, 1.0, 1.0],
        "b": [100.0] * warmup + [2.0, 3.0, 2.0, 2.0, 9.0],
        "c": [100.0] * warmup + [4.0] * rounds,
    }
    result = measure_interleaved(
        make_variants(clock, durations, log), rounds=rounds, warmup=warmup, clock=clock, seed=7
    )
    # warm-up calls come first and are not timed
    assert sorted(log[: 3 * warmup]) == sorted(["a", "b", "c"] * warmup)
    timed_calls = log[3 * warmup :]
    expected = [name for order in round_orders(["a", "b", "c"], rounds, 7) for name in order]
    assert timed_calls == expected
    a, b, c = result["a"], result["b"], result["c"]
    assert list(result) == ["a", "b", "c"]
    assert a.samples == (1.0, 1.0, 5.0, 1.0, 1.0)  # round order, warm-up excluded
    assert (a.median, a.min, a.max, a.n) == (1.0, 1.0, 5.0, 5)
    assert a.mean == pytest.approx(1.8)
    assert b.median == 2.0 and b.max == 9.0
    assert c.stdev == 0.0 and c.unit == "s"


def test_sync_brackets_every_sample() -> None:
    clock = FakeClock()
    events: list[str] = []

    def sync() -> None:
        events.append("sync")

    def work() -> None:
        events.append("work")
        clock.now += 1.0

    measure_interleaved({"x": work, "y": work}, rounds=3, warmup=1, sync=sync, clock=clock)
    timed = events[2:]  # two warm-up calls
    assert timed[0] == "sync"  # once after the warm-up
    assert timed[1:] == ["sync", "work", "sync"] * 6


def test_threads_recorded_per_measurement() -> None:
    clock = FakeClock()
    log: list[str] = []
    m = measure_interleaved(make_variants(clock, {"a": [1.0]}, log), 1, 0, clock=clock,
                            threads=3)
    assert m["a"].threads == 3


def test_self_timed_variant_reports_its_own_seconds() -> None:
    clock = FakeClock()

    def remote() -> float:
        clock.now += 10.0  # waiting on workers: not what is measured
        return 0.25

    def local() -> None:
        clock.now += 1.0

    m = measure_interleaved({"remote": remote, "local": local}, rounds=3, warmup=1, clock=clock)
    assert m["remote"].samples == (0.25, 0.25, 0.25)
    assert m["local"].samples == (1.0, 1.0, 1.0)


def test_bad_rounds_rejected() -> None:
    with pytest.raises(ValueError, match="rounds=0"):
        measure_interleaved({"a": lambda: None}, rounds=0, warmup=0)


def test_pairwise_ratios_are_per_round_not_ratio_of_medians() -> None:
    # Drift: the machine slows down each round, affecting both variants alike.
    a = Measurement.from_samples("a", [1.0, 2.0, 4.0, 8.0, 16.0])
    b = Measurement.from_samples("b", [2.0, 4.0, 8.0, 16.0, 1.0])  # last round: burst on a
    (ratio,) = pairwise_ratios({"a": a, "b": b}, [("a", "b")])
    assert ratio.name == "a/b"
    assert ratio.samples == (0.5, 0.5, 0.5, 0.5, 16.0)
    assert ratio.median == 0.5
    assert (ratio.min, ratio.max) == (0.5, 16.0)
    # the ratio of the medians (4/4) hides the steady 2x difference the rounds show
    assert a.median / b.median == 1.0


def test_pairwise_ratios_reject_mismatched_runs() -> None:
    a = Measurement.from_samples("a", [1.0, 2.0])
    b = Measurement.from_samples("b", [1.0])
    with pytest.raises(ValueError, match="same interleaved run"):
        pairwise_ratios({"a": a, "b": b}, [("a", "b")])
    with pytest.raises(KeyError, match="zzz"):
        pairwise_ratios({"a": a}, [("a", "zzz")])


def test_zero_denominator_gives_inf_and_json_stays_valid() -> None:
    a = Measurement.from_samples("a", [1.0])
    z = Measurement.from_samples("z", [0.0])
    (r,) = pairwise_ratios({"a": a, "z": z}, [("a", "z")])
    assert math.isinf(r.median)
    assert json.loads(dumps(r.to_json()))["median"] == "inf"


def test_measurement_json_round_trip_and_derive() -> None:
    m = Measurement.from_samples("copy", [0.5, 0.25, 1.0], threads=2, extra={"bytes": 1000})
    again = Measurement.from_json(json.loads(json.dumps(m.to_json())))
    assert again == m
    rate = m.derive(lambda s: 1000 / s / 1e9, unit="GB/s")
    # a decreasing transform: the slowest sample becomes the minimum rate
    assert rate.min == pytest.approx(1e-6) and rate.max == pytest.approx(4e-6)
    assert rate.median == pytest.approx(2e-6) and rate.unit == "GB/s"
    assert rate.extra == {"bytes": 1000} and rate.threads == 2
    assert m.with_extra(k=1).extra == {"bytes": 1000, "k": 1}
    with pytest.raises(ValueError, match="no samples"):
        Measurement.from_samples("empty", [])


def test_parse_pressure_sample_and_garbage() -> None:
    parsed = parse_pressure(SAMPLE_PSI)
    assert parsed["some"].avg10 == 7.74
    assert parsed["some"].avg300 == 2.20
    assert parsed["some"].total_us == 8300434
    assert parsed["full"].total_us == 0
    assert parse_pressure("some avg10=x total=3\nnonsense\n") == {}


def test_pressure_monitor_reports_stall_delta(tmp_path: Path) -> None:
    psi = tmp_path / "cpu"
    psi.write_text(SAMPLE_PSI)
    clock = FakeClock()
    monitor = PressureMonitor(psi, clock=clock)
    monitor.start()
    clock.now += 2.0
    psi.write_text(SAMPLE_PSI.replace("total=8300434", "total=8800434").replace(
        "some avg10=7.74", "some avg10=20.50"))
    pressure = monitor.stop()
    assert pressure is not None
    assert pressure.stalled_us == 500000
    assert pressure.wall_s == 2.0
    assert pressure.stalled_fraction == pytest.approx(0.25)
    assert (pressure.avg10_start, pressure.avg10_end) == (7.74, 20.5)


def test_pressure_monitor_absent_file(tmp_path: Path) -> None:
    monitor = PressureMonitor(tmp_path / "missing")
    monitor.start()
    assert monitor.stop() is None


def test_plot_values_and_best() -> None:
    m = Measurement.from_samples("m", [1.0, 2.0, 6.0], extra={"saved_bytes": 42})
    assert plot_value(m, "median") == (2.0, 1.0, 4.0)
    centre, low, high = plot_value(m, "mean")
    assert centre == 3.0 and low == high == pytest.approx(m.stdev)
    assert plot_value(m, "extra:saved_bytes") == (42.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="plot value"):
        plot_value(m, "p99")
    assert best_index([3.0, 1.0, 2.0], "min") == 1
    assert best_index([3.0, 1.0, 2.0], "max") == 0
    assert best_index([3.0], None) is None


def test_write_report_files_and_schema(tmp_path: Path) -> None:
    from torchgpu.bench.report import load_results, write_report

    ms = tuple(Measurement.from_samples(f"v{i}", [i + 1.0, i + 1.5], extra={"x_bytes": i * 2**20})
               for i in range(3))
    result = SuiteResult(
        suite="demo", quick=True, devices=("cpu",), measurements=ms,
        ratios=tuple(pairwise_ratios({m.name: m for m in ms}, [("v1", "v0")])),
        plots=(
            Plot("bars.png", "bar", "bars", "s", names=("v0", "v1", "v2")),
            Plot("line.png", "line", "line", "s", names=("v0", "v1", "v2"), x=(1, 2, 3),
                 value="mean", best="min"),
            Plot("none.png", "bar", "absent", "s", names=("nope",)),
        ),
        notes=("a note",), config={"batch": 4},
    )
    doc = write_report(result, tmp_path, None, wall_s=1.5)
    assert (tmp_path / "bars.png").stat().st_size > 1000
    assert (tmp_path / "line.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "none.png").exists()
    loaded = load_results(tmp_path)
    assert loaded == json.loads(json.dumps(doc))
    for key in ("suite", "quick", "devices", "device_names", "torch", "threads",
                "cpu_pressure", "measurements", "ratios", "notes", "config"):
        assert key in loaded
    assert [p["filename"] for p in loaded["plots"]] == ["bars.png", "line.png"]
    assert loaded["ratios"][0]["samples"] == [2.0, 2.5 / 1.5]
    md = (tmp_path / "report.md").read_text()
    assert "| v1/v0 | 1.833 |" in md and "a note" in md and "x_bytes=1.00 MiB" in md


@pytest.mark.gpu
def test_cuda_event_clock_and_sync_time_gpu_work() -> None:
    import torch

    from torchgpu.bench.timer import cuda_event_clock, cuda_sync

    device = torch.device("cuda", 0)
    a = torch.randn(2048, 2048, device=device)

    def product() -> None:
        torch.mm(a, a)

    seconds = cuda_event_clock(device)(product)
    assert seconds > 0
    m = measure_interleaved({"mm": product}, rounds=3,
                            warmup=1, sync=cuda_sync([device]))
    assert m["mm"].n == 3 and m["mm"].min > 0
