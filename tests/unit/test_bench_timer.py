"""The measuring core, tested with fake clocks: no assertion depends on real elapsed time."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from torchgpu.bench.pressure import PressureMonitor, parse_pressure
from torchgpu.bench.report import dumps
from torchgpu.bench.result import Plot, SuiteResult, best_index, plot_value
from torchgpu.bench.timer import (
    Measurement,
    measure_interleaved,
    pairwise_ratios,
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
def test_cuda_sync_times_gpu_work() -> None:
    import torch

    from torchgpu.bench.timer import cuda_sync

    device = torch.device("cuda", 0)
    a = torch.randn(2048, 2048, device=device)

    def product() -> None:
        torch.mm(a, a)

    m = measure_interleaved({"mm": product}, rounds=3,
                            warmup=1, sync=cuda_sync([device]))
    assert m["mm"].n == 3 and m["mm"].min > 0


# --- threads ---------------------------------------------------------------------------


def test_worker_threads_recorded_per_variant() -> None:
    import torch

    clock = FakeClock()
    log: list[str] = []
    variants = make_variants(clock, {"here": [1.0], "workers": [2.0]}, log)
    m = measure_interleaved(variants, 1, 0, clock=clock, threads={"workers": 7})
    assert m["workers"].threads == 7
    assert m["here"].threads == torch.get_num_threads()
    assert m["here"].with_threads(5).threads == 5 and m["here"].with_threads(5).samples == (1.0,)


# --- ratios of rates (work per sample differs) ------------------------------------------


def test_rate_ratio_compares_work_per_second_not_sample_seconds() -> None:
    from torchgpu.bench.timer import rate_ratios

    # A GPU sample repeats the product 64x, the CPU's once: seconds alone mislead.
    cpu = Measurement.from_samples("cpu", [2.0, 4.0])
    gpu = Measurement.from_samples("gpu", [0.5, 0.5])
    (r,) = rate_ratios({"cpu": cpu, "gpu": gpu}, {"cpu": 1.0, "gpu": 64.0}, [("gpu", "cpu")])
    assert r.samples == (64 / 0.5 / (1 / 2.0), 64 / 0.5 / (1 / 4.0))  # (256, 512)
    assert r.median == 384.0
    (naive,) = pairwise_ratios({"cpu": cpu, "gpu": gpu}, [("cpu", "gpu")])
    assert naive.median == 6.0  # what dividing the seconds reported: 64x too low
    with pytest.raises(KeyError, match="no work given for gpu"):
        rate_ratios({"cpu": cpu, "gpu": gpu}, {"cpu": 1.0}, [("gpu", "cpu")])


def test_matmul_speedup_is_the_tflops_ratio_with_different_repeats() -> None:
    """CPU stand-in for the GPU-only arithmetic: a cuda-named variant with 64x the repeats."""
    import torch

    from torchgpu.bench.suites.matmul import _tflops, flops_per_sample, repeats, speedups

    n = 512
    cpu_reps, gpu_reps = repeats(n, torch.device("cpu")), repeats(n, torch.device("cuda", 0))
    assert (cpu_reps, gpu_reps) == (1, 64)
    names = {"cpu": "cpu n=512 float32", "gpu": "cuda:0 n=512 float32"}
    timed = {names["cpu"]: Measurement.from_samples(names["cpu"], [0.02, 0.03, 0.025]),
             names["gpu"]: Measurement.from_samples(names["gpu"], [0.004, 0.005, 0.004])}
    flops = {names["cpu"]: flops_per_sample(n, cpu_reps),
             names["gpu"]: flops_per_sample(n, gpu_reps)}
    (ratio,) = speedups(timed, flops, names["cpu"])
    assert ratio.numerator == names["gpu"] and ratio.denominator == names["cpu"]
    cpu_tflops = timed[names["cpu"]].derive(_tflops(flops[names["cpu"]]), "TFLOP/s")
    gpu_tflops = timed[names["gpu"]].derive(_tflops(flops[names["gpu"]]), "TFLOP/s")
    expected = [g / c for g, c in zip(gpu_tflops.samples, cpu_tflops.samples, strict=True)]
    assert ratio.samples == pytest.approx(expected)
    # per round 320, 384, 400: the median round is the second (64 x 0.03 / 0.005)
    assert ratio.median == pytest.approx(64 * 0.03 / 0.005)
    assert speedups(timed, flops, "cpu n=1024 float32") == []  # no CPU row at that size


# --- transfer arithmetic (GPU-only rows, checked on CPU) ---------------------------------


def test_transfer_hidden_fraction_and_bandwidth_arithmetic() -> None:
    from torchgpu.bench.suites.transfer import gb_per_s, hidden_fractions, prefetch_names

    assert hidden_fractions([3.0, 3.0, 3.0, 2.0], [2.0, 3.5, 0.0, 2.0], [2.0, 2.0, 1.0, 0.0]) \
        == [0.5, 0.0, 1.0, 0.0]  # half hidden; slower than serial; clipped; nothing copied
    assert gb_per_s(2 * 10**9)(0.5) == 4.0 and math.isinf(gb_per_s(1)(0.0))
    names = prefetch_names(__import__("torch").device("cuda", 1))
    assert names["hidden"] == "copy hidden by Prefetcher cuda:1"
    assert len(set(names.values())) == 5


# --- verdicts ---------------------------------------------------------------------------


def test_verdicts_say_faster_slower_and_whether_the_claim_holds() -> None:
    from torchgpu.bench.timer import Ratio
    from torchgpu.bench.verdict import (
        inverted,
        rate_verdict,
        time_factor,
        time_verdict,
        value_verdict,
    )

    slower = Ratio("model", "single", (1.04, 1.06, 1.05), 1.05, 1.04, 1.06)
    text = time_verdict("model", "single", slower, seed="1.07x slower", expect="slower")
    assert text == ("model vs single: 1.05x slower [1.04x slower .. 1.06x slower] "
                    "(seed: 1.07x slower): claim holds")
    faster = Ratio("pipe", "single", (0.5, 0.8), 0.65, 0.5, 0.8)
    assert time_verdict("pipe", "single", faster, expect="faster").endswith("claim holds")
    assert time_verdict("pipe", "single", faster, expect="slower").endswith("does not hold here")
    mixed = Ratio("a", "b", (0.9, 1.1), 1.0, 0.9, 1.1)
    assert "unclear" in time_verdict("a", "b", mixed, expect="faster")
    assert time_factor(0.5) == "2.00x faster" and time_factor(2.0) == "2.00x slower"
    bw = Ratio("pinned", "pageable", (2.0, 2.5), 2.25, 2.0, 2.5)
    assert rate_verdict("pinned", "pageable", bw, "bandwidth", expect="higher") == (
        "pinned vs pageable: 2.25x the bandwidth [2.00x .. 2.50x]: claim holds")
    assert value_verdict("2 segments", "none", 50, 200, "bytes") == (
        "2 segments vs none: 0.25x the bytes")
    back = inverted(faster)
    assert (back.numerator, back.samples, back.median) == ("single", (2.0, 1.25), 1.625)


# --- plots ------------------------------------------------------------------------------


def test_plot_error_bars_only_where_there_is_spread(tmp_path: Path) -> None:
    from torchgpu.bench.plots import _errors, write_plot
    from torchgpu.bench.result import Series

    assert _errors([(5.0, 0.0, 0.0), (3.0, 0.0, 0.0)], 1.0) is None
    assert _errors([(5.0, 1.0, 2.0)], 0.5) == [[0.5], [1.0]]
    ms = {f"{d} n={n}": Measurement.from_samples(f"{d} n={n}", [n / 100, n / 90],
                                                 unit="TFLOP/s")
          for d in ("cpu", "cuda:0") for n in (256, 1024, 8192)}
    plot = Plot("lines.png", "line", "mm", "TFLOP/s", names=(), yscale="log", xscale="log2",
                series=tuple(Series(d, tuple(f"{d} n={n}" for n in (256, 1024, 8192)),
                                    (256.0, 1024.0, 8192.0)) for d in ("cpu", "cuda:0")))
    assert plot.all_names() == tuple(ms)
    assert write_plot(plot, ms, tmp_path, "cpu (test); quick") == tmp_path / "lines.png"
    assert (tmp_path / "lines.png").read_bytes()[:4] == b"\x89PNG"
    sweep = Plot("sweep.png", "line", "sweep", "s", names=("cpu n=256", "cpu n=1024"),
                 x=(1.0, 60.0), value="mean", best="min", xscale="log", reference="cpu n=8192")
    assert write_plot(sweep, ms, tmp_path) is not None
    only_reference = Plot("ref.png", "line", "r", "s", names=("absent",), x=(1.0,),
                          reference="cpu n=256")
    assert write_plot(only_reference, ms, tmp_path) is None


# --- report, noise, out directory --------------------------------------------------------


def test_pressure_is_clamped_and_flags_noise(tmp_path: Path) -> None:
    psi = tmp_path / "cpu"
    psi.write_text(SAMPLE_PSI)
    clock = FakeClock()
    monitor = PressureMonitor(psi, clock=clock)
    monitor.start()
    clock.now += 1.0
    psi.write_text(SAMPLE_PSI.replace("total=8300434", "total=9400434"))  # 1.1 s stalled in 1 s
    pressure = monitor.stop()
    assert pressure is not None and pressure.stalled_fraction == 1.0 and pressure.noisy
    from torchgpu.bench.pressure import NOISY_STALLED_FRACTION, is_noisy

    assert not is_noisy(NOISY_STALLED_FRACTION) and is_noisy(NOISY_STALLED_FRACTION + 0.01)
    assert not is_noisy(None)


def test_report_records_provenance_verdicts_and_warns_when_noisy(tmp_path: Path) -> None:
    from torchgpu.bench.pressure import CpuPressure
    from torchgpu.bench.report import noise_warning, render_markdown, write_report

    ms = (Measurement.from_samples("a", [1.0, 2.0]),)
    result = SuiteResult(suite="demo", quick=False, devices=("cpu",), measurements=ms,
                         verdicts=("a vs b: 1.05x slower",))
    calm = CpuPressure(1.0, 2.0, 100_000, 1.0, 0.1)
    doc = write_report(result, tmp_path, calm, wall_s=1.0, argv=["torchgpu", "bench", "demo"],
                       threads=3)
    assert doc["argv"] == ["torchgpu", "bench", "demo"] and doc["threads"] == 3
    assert doc["torchgpu"] and doc["verdicts"] == ["a vs b: 1.05x slower"]
    assert "cuda" in doc and (doc["git"] is None or isinstance(doc["git"], str))
    assert doc["noisy"] is False and noise_warning(doc) is None
    md = (tmp_path / "report.md").read_text()
    assert "## Verdicts" in md and "- a vs b: 1.05x slower" in md
    assert "command: `torchgpu bench demo`" in md and "unreliable" not in md
    loud = {**doc, "noisy": True, "cpu_pressure": {**doc["cpu_pressure"],
                                                   "stalled_fraction": 0.93}}
    warning = noise_warning(loud)
    assert warning is not None and "93%" in warning and "threshold is 20%" in warning
    assert render_markdown(loud).splitlines()[2] == f"**{warning}**"


def test_git_revision_outside_a_checkout_is_none(tmp_path: Path) -> None:
    from torchgpu.bench.report import git_revision

    assert git_revision(tmp_path) is None


def test_prepare_out_refuses_files_and_non_empty_dirs(tmp_path: Path) -> None:
    from torchgpu.bench.runner import check_threads, prepare_out
    from torchgpu.errors import UsageError

    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(UsageError, match="is a file, not a directory"):
        prepare_out(afile)
    with pytest.raises(UsageError, match="cannot create"):
        prepare_out(afile / "sub")
    old = tmp_path / "old"
    old.mkdir()
    for name in ("results.json", "report.md", "peak.png", "mine.txt"):
        (old / name).write_text("x")
    with pytest.raises(UsageError, match=r"not empty .*--force"):
        prepare_out(old)
    assert prepare_out(old, force=True) == old
    assert sorted(p.name for p in old.iterdir()) == ["mine.txt"]  # only a run's files go
    assert prepare_out(tmp_path / "new" / "deep").is_dir()
    with pytest.raises(UsageError, match="--threads 0"):
        check_threads(0)
