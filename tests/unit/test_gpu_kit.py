"""The GPU check (benchmarks/gpu/) kept alive without a GPU: every command it would run
parses with the real parsers, scripts exist and accept their flags, the budgets fit the
9-minute limit, the tag table, the packer, the summary and its README rendering, and one
cheap step run for real on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
KIT = REPO / "benchmarks" / "gpu"
sys.path.insert(0, str(KIT))
sys.path.insert(0, str(REPO / "benchmarks"))

import kit  # noqa: E402
import pack  # noqa: E402
import parsecheck  # noqa: E402
import steps  # noqa: E402
import summarize  # noqa: E402
import summary  # noqa: E402
from tag import gpu_tag  # noqa: E402

GIB = 2**30
CTX = steps.Ctx(repo=REPO, results="benchmarks/results/test-gpu",
                scratch="runs/gpu-kit/test-gpu")


def dry_run(*args: str) -> str:
    done = subprocess.run([sys.executable, str(KIT / "kit.py"), "--dry-run", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("part", ["tests", "bench", "lm", "train", "multi", "all",
                                  "default", "rest"])
def test_dry_run_lists_every_step_of_the_part(part: str) -> None:
    text = dry_run("--part", part, "--tag", "test-gpu", "--threads", str(CTX.threads))
    plan = steps.make_plan(part)
    assert plan.steps
    for step in plan.steps:
        assert f"] {step.name} (" in text
        assert kit.display(step.command(CTX), step.environment(CTX)) in text
    if part != "multi":  # what needs 2 GPUs is listed with its command, not dropped
        assert "needs 2 GPUs" in text
        for step in steps.multi_gpu_steps():
            assert f"{step.name}: " in text


def test_make_dry_run_prints_the_commands() -> None:
    done = subprocess.run(["make", "-s", "gpu-check", "DRY_RUN=1", "PART=bench"], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "python3 -m torchgpu bench matmul --device cuda:0" in done.stdout
    assert "benchmarks/results/<gpu-tag>/matmul" in done.stdout


@pytest.mark.parametrize("step", steps.STEPS, ids=lambda s: s.name)
def test_every_command_parses_with_the_real_parser(step: steps.Step) -> None:
    argv = step.command(CTX)
    checked = parsecheck.check_command(REPO, argv, step.environment(CTX))
    assert checked


@pytest.mark.parametrize("argv", [
    ["py", "-m", "torchgpu", "train", "--no-such-flag"],
    ["py", "-m", "torchgpu", "train", "--strategy", "pipeline", "--devices", "cpu,cpu",
     "--device", "cpu"],
    ["py", "-m", "torchgpu", "train", "--precision", "fp8"],
    ["py", "-m", "torchgpu", "bench", "no-such-suite"],
    ["py", "-m", "torchgpu", "bench", "matmul", "--size", "medium"],
    ["py", "-m", "torchgpu", "no-such-verb"],
    ["py", "benchmarks/gpu/resnet_step.py", "--out", "x", "--no-such-flag"],
    ["py", "benchmarks/gpu/no_such_script.py"],
    ["py", "benchmarks/gpu/gpt2_step.py", "--out", "x", "--time-limit", "soon"],
    ["py", "benchmarks/gpu/gpt2_step.py", "--device", "cuda0", "--out", "x"],
    ["py", "-m", "pytest", "tests/no_such_test.py"],
    # pytest's own parser, with its plugins: flags, choices, the -m grammar
    ["py", "-m", "pytest", "--bogus-flag", "tests/gpu"],
    ["py", "-m", "pytest", "-n", "8", "--dist", "loadgrp", "tests/gpu"],
    ["py", "-m", "pytest", "--timout", "120", "tests/gpu"],
    ["py", "-m", "pytest", "-m", "gpu or", "tests/gpu"],
    # device values, in every form the commands take them
    ["py", "-m", "torchgpu", "bench", "transfer", "--device", "gpu0"],
    ["py", "-m", "torchgpu", "bench", "split-sweep", "--device", "cuda:0,cuda1"],
    ["py", "-m", "torchgpu", "train", "--strategy", "pipeline", "--devices", "cuda:0,gpu:1"],
    ["py", "benchmarks/gpu/resnet_step.py", "--device", "cuda0", "--out", "x"],
    # user-model specs resolve (imported, not called)
    ["py", "-m", "torchgpu", "train", "--model", "tests/user_models.py:lm_factroy", "--data",
     "tests/user_models.py:lm_data"],
    ["py", "-m", "torchgpu", "train", "--model", "tests/user_models.py:lm_factory", "--data",
     "tests/no_such.py:lm_data"],
])
def test_the_parse_check_refuses_what_would_fail(argv: list[str]) -> None:
    with pytest.raises(parsecheck.CommandError):
        parsecheck.check_command(REPO, argv)


@pytest.mark.parametrize("env", [{"TORCHGPU_TEST_DEVCE": "cuda"},
                                 {"TORCHGPU_FAULT_HANG_STEP": "3"}])
def test_the_parse_check_refuses_variables_nothing_reads(env: dict[str, str]) -> None:
    with pytest.raises(parsecheck.CommandError, match="no code reads"):
        parsecheck.check_command(REPO, ["py", "-m", "torchgpu", "env"], env)
    assert {"TORCHGPU_TEST_DEVICE", "TORCHGPU_FAULT_HANG_AT_STEP",
            "TORCHGPU_FAULT_RANK"} <= parsecheck.known_env_names(REPO)


def test_the_parse_check_returns_the_pytest_paths() -> None:
    step = next(s for s in steps.STEPS if s.name == "tests-gpu")
    assert parsecheck.check_pytest(REPO, step.command(CTX)[3:]) == ["tests"]
    assert not (REPO / "benchmarks" / "results" / "test-gpu").exists()  # nothing ran


def planner_consulted(argv: list[str], tmp_path: Path) -> bool:
    """Whether `torchgpu train argv` would let the planner (``--strategy auto``) decide
    the run's batch: decide_strategy as the CLI calls it, with a planner that only says
    it was asked (and a tiny data set: only one sample's shape is read)."""
    import dataclasses

    from torchgpu.cli.train_flags import config_from_argv
    from torchgpu.train.auto_strategy import decide_strategy
    from torchgpu.train.config import resolve
    from torchgpu.train.config_checks import validate
    from torchgpu.train.plugin import task_for_config

    class Asked(Exception):
        pass

    def planner(*args: Any, **kwargs: Any) -> Any:
        raise Asked

    config = config_from_argv(argv)
    validate(config)
    config = dataclasses.replace(resolve(config), out=str(tmp_path / "run"))
    small = dataclasses.replace(config, data_size=48, batch_size=16, device="cpu")
    try:
        decision = decide_strategy(config, 1, task_for_config(small), plan_fn=planner,
                                   small_step_bytes=0)
    except Asked:
        return True
    assert decision.config == config  # nothing rewritten
    return False


def test_the_oom_step_reaches_the_loop_with_its_batch(tmp_path: Path) -> None:
    """train-oom-backoff must really run out of memory: 8192 samples in one micro-batch,
    in fp32, with nothing (the planner, accumulation, a batch search) changing that."""
    step = next(s for s in steps.STEPS if s.name == "train-oom-backoff")
    argv = step.command(CTX)
    assert argv[1:4] == ["-m", "torchgpu", "train"]
    from torchgpu.cli.train_flags import config_from_argv

    config = config_from_argv(argv[4:])
    assert (config.strategy, config.batch_size, config.precision) == ("single", 8192, "fp32")
    assert config.accumulate == 1 and config.effective_batch_size is None
    assert not config.auto_batch_size and config.data_size is not None
    assert config.data_size - config.data_size // 3 >= config.batch_size  # one full batch
    assert not planner_consulted(argv[4:], tmp_path)
    # The check catches the step as it was: under the default --strategy auto the planner
    # would re-plan 8192 as micro-batches that fit, and nothing would run out of memory.
    i = argv.index("--strategy")
    assert planner_consulted(argv[4:i] + argv[i + 2:], tmp_path)


def test_scripts_exist_and_compile() -> None:
    scripts = {a for s in steps.STEPS for a in s.command(CTX) if a.endswith(".py")}
    assert {"benchmarks/gpu/resnet_step.py", "benchmarks/gpu/memory_check.py",
            "benchmarks/gpu/gpt2_step.py"} <= scripts
    for path in scripts:
        compile((REPO / path).read_text(), path, "exec")
    assert os.access(REPO / "benchmarks" / "gpu.sh", os.X_OK)


def test_budgets_fit_nine_minutes_and_each_part_a_device_call() -> None:
    assert steps.ALL_DEADLINE_S <= 9 * 60
    assert steps.PART_DEADLINE_S <= 9.5 * 60  # one device call: 600 s
    usable = steps.PART_DEADLINE_S - steps.RESERVE_S - steps.STOP_GRACE_S
    for part in steps.PARTS:
        total = sum(s.budget_s for s in steps.STEPS if s.part == part)
        assert total <= usable, part
        if part != "lm":  # lm is one step: alone, its budget is scaled to the whole call
            assert total >= 0.9 * usable, part  # a part uses most of its call
    assert kit.DUMP_WAIT_S + kit.INT_WAIT_S + kit.TERM_WAIT_S <= steps.STOP_GRACE_S
    for step in steps.STEPS:
        assert 0 < step.expect_s < step.budget_s, step.name
        if "pytest" in step.argv:  # a hung test fails alone, well inside the step
            timeout = int(step.argv[step.argv.index("--timeout") + 1])
            assert timeout == steps.TEST_TIMEOUT_S and 2 * timeout <= step.budget_s
    # PART=all: the priority-1 steps' expected times (and GPU detection) fit its deadline
    # with room to spare (GPT-2's compile, ~150 s, is the largest)
    first = [s for s in steps.make_plan("all").steps if s.priority == 1]
    all_usable = steps.ALL_DEADLINE_S - steps.RESERVE_S - steps.STOP_GRACE_S
    assert steps.START_S + sum(s.expect_s for s in first) <= 0.9 * all_usable
    assert len({s.name for s in steps.STEPS}) == len(steps.STEPS)


def test_all_runs_by_priority_and_a_part_alone_keeps_its_order() -> None:
    plan = steps.make_plan("all")
    assert not plan.fill and plan.deadline_s == steps.ALL_DEADLINE_S
    priorities = [s.priority for s in plan.steps]
    assert priorities == sorted(priorities)
    assert plan.steps[0].name == "tests-gpu"
    assert {s.name for s in plan.steps if s.priority == 3} == {"tests-cuda-aware",
                                                                 "bench-split-sweep"}
    bench = steps.make_plan("bench")
    assert bench.fill and bench.deadline_s == steps.PART_DEADLINE_S
    assert bench.steps[-1].name == "bench-split-sweep"


def test_default_part_runs_the_least_known_first_within_eight_minutes() -> None:
    """What benchmarks/gpu.sh runs with no PART: the GPU tests, the GPT-2 loop, then the
    transfer, ResNet-50, memory-estimate, batch-search and OOM figures, in that order,
    their expected times (and GPU detection) inside 480 s with room to spare; the two
    plain training runs only in what is left."""
    plan = steps.make_plan("default")
    assert plan.deadline_s == steps.DEFAULT_DEADLINE_S <= 8 * 60 and not plan.fill
    assert [s.name for s in plan.steps] == list(steps.DEFAULT_STEPS)
    assert [s.name for s in plan.steps][:7] == [
        "tests-gpu", "gpt2-step", "bench-transfer", "bench-resnet50-step", "estimate-memory",
        "train-auto-batch", "train-oom-backoff"]
    usable = plan.deadline_s - steps.RESERVE_S - steps.STOP_GRACE_S
    needed = steps.START_S + sum(s.expect_s for s in plan.steps
                                 if s.name not in ("train-fp32", "train-bf16"))
    assert needed <= 0.9 * usable
    for step in plan.steps:  # each step's limit is its budget: none eats the whole call
        assert step.expect_s < step.budget_s <= usable / 2, step.name
    gpt2 = next(s for s in plan.steps if s.name == "gpt2-step")
    argv = gpt2.command(CTX)
    # the script gives up the compiled mode before the kit's limit would cut it off
    assert float(argv[argv.index("--time-limit") + 1]) < gpt2.budget_s


def test_rest_is_every_other_one_gpu_step() -> None:
    default = {s.name for s in steps.make_plan("default").steps}
    rest = steps.make_plan("rest")
    assert not rest.fill and rest.deadline_s == steps.PART_DEADLINE_S
    one_gpu = {s.name for s in steps.STEPS if s.needs != "2gpus"}
    assert {s.name for s in rest.steps} == one_gpu - default
    assert [s.priority for s in rest.steps] == sorted(s.priority for s in rest.steps)
    usable = rest.deadline_s - steps.RESERVE_S - steps.STOP_GRACE_S
    assert steps.START_S + sum(s.expect_s for s in rest.steps) <= usable


def test_gpu_sh_with_no_part_runs_the_default_part() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PART"}
    done = subprocess.run(["bash", "benchmarks/gpu.sh"], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=False,
                          env={**env, "DRY_RUN": "1", "PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("# GPU check, PART=default:")
    listed = [line.split("] ")[1].split(" (")[0] for line in done.stdout.splitlines()
              if line.startswith("[")]
    assert listed == list(steps.DEFAULT_STEPS)
    assert "python3 benchmarks/gpu/gpt2_step.py --device cuda:0" in done.stdout


def test_step_limits_fill_a_part_and_keep_budgets_in_all() -> None:
    a = steps.Step("a", "bench", 100, ("{py}",), expect_s=30)
    b = steps.Step("b", "bench", 300, ("{py}",), expect_s=200)
    part = steps.Plan((a, b), deadline_s=600)
    grace = steps.STOP_GRACE_S
    # alone in its call, `a` gets its share of all the time left: 100/400 of it
    assert kit.step_limit(part, a, 300, 800 + grace) == pytest.approx(200)
    # time `a` did not use goes to `b`
    assert kit.step_limit(part, b, 0, 700 + grace) == pytest.approx(700)
    everything = steps.Plan((a, b), deadline_s=600, fill=False)
    assert kit.step_limit(everything, a, 300, 800 + grace) == 100  # its own budget
    assert kit.step_limit(everything, b, 0, 250 + grace) == 250  # cut to the deadline
    assert kit.step_limit(everything, b, 0, 150 + grace) is None  # expects 200: skipped


def test_the_plan_covers_the_spec() -> None:
    names = {s.name for s in steps.STEPS}
    for suite in ("matmul", "transfer", "checkpointing", "accumulation", "parallel",
                  "split-sweep", "overhead"):
        assert f"bench-{suite}" in names
    assert {"train-fp32", "train-bf16", "train-auto-batch", "train-oom-backoff",
            "estimate-memory", "devices", "env", "doctor", "tests-gpu"} <= names
    multi = " ".join(" ".join(s.command(CTX)) for s in steps.multi_gpu_steps())
    for needed in ("dp-ddp", "--strategy ddp", "--strategy dp", "--strategy model",
                   "--strategy pipeline"):
        assert needed in multi


def test_cuda_test_files_are_the_suites_files_that_mention_cuda() -> None:
    files = steps.cuda_test_files(REPO)
    assert "tests/unit/test_transfer.py" in files
    assert "tests/unit/test_gpu_kit.py" not in files
    for name in files:
        assert "cuda" in (REPO / name).read_text()


def test_unknown_step_or_part_is_refused() -> None:
    with pytest.raises(ValueError, match="no step named nope"):
        steps.make_plan("bench", ["nope"])
    with pytest.raises(ValueError, match="PART='gpu'"):
        steps.make_plan("gpu")


@pytest.mark.parametrize(("name", "total", "tag"), [
    ("NVIDIA H100 80GB HBM3", int(79.19 * GIB), "h100-sxm-80gb"),
    ("NVIDIA H100 PCIe", int(79.6 * GIB), "h100-pcie-80gb"),
    ("NVIDIA H100 NVL", int(93.1 * GIB), "h100-nvl-94gb"),
    ("NVIDIA H200", int(139.8 * GIB), "h200-sxm-141gb"),
    ("NVIDIA A100-SXM4-80GB", None, "a100-sxm4-80gb"),
    ("NVIDIA A100-PCIE-40GB", int(39.4 * GIB), "a100-pcie-40gb"),
    ("Tesla V100-SXM2-16GB", None, "v100-sxm2-16gb"),
    ("NVIDIA GeForce RTX 4090", int(23.6 * GIB), "rtx-4090-24gb"),
    ("NVIDIA L4", int(22.5 * GIB), "l4-24gb"),
    ("NVIDIA RTX A6000", int(47.5 * GIB), "rtx-a6000-48gb"),
    ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", int(9.8 * GIB), "h100-sxm-mig-1g-10gb"),
    ("Some Card", None, "some-card"),
    ("Odd GPU", 28 * GIB, "odd-28gb"),
])
def test_gpu_tag(name: str, total: int | None, tag: str) -> None:
    assert gpu_tag(name, total) == tag


def test_gpu_tag_refuses_an_empty_name() -> None:
    with pytest.raises(ValueError, match="no letters"):
        gpu_tag(" - ")


def test_packer_writes_one_small_archive(tmp_path: Path, monkeypatch: Any) -> None:
    results = tmp_path / "h100-sxm-80gb"
    (results / "matmul").mkdir(parents=True)
    (results / "matmul" / "results.json").write_text('{"suite": "matmul"}')
    (results / "summary.md").write_text("# GPU check\n")
    (results / "big.bin").write_bytes(b"\0" * 2048)
    monkeypatch.setattr(pack, "FILE_MAX_BYTES", 1024)
    archive, skipped = pack.pack(results, tmp_path / "out", "gpu-h100-sxm-80gb-bench.tar.gz")
    assert archive == tmp_path / "out" / "gpu-h100-sxm-80gb-bench.tar.gz"
    assert [s.split(" ")[0] for s in skipped] == ["big.bin"]
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
        note = tar.extractfile("h100-sxm-80gb/kit/packing-gpu-h100-sxm-80gb-bench.txt")
        assert note is not None and b"big.bin" in note.read()
    assert {"h100-sxm-80gb/matmul/results.json", "h100-sxm-80gb/summary.md"} <= names
    assert "h100-sxm-80gb/big.bin" not in names
    assert pack.archive_name("x", ("tests",)) != pack.archive_name("x", ("bench",))


# --- the summary, on fake results ---------------------------------------------------------


def measurement(name: str, median: float, unit: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "median": median, "min": median * 0.9, "max": median * 1.1,
            "unit": unit, "n": 3, "threads": 1, "samples": [median] * 3, "extra": extra}


def ratio(num: str, den: str, median: float) -> dict[str, Any]:
    return {"name": f"{num}/{den}", "numerator": num, "denominator": den, "median": median,
            "min": median * 0.95, "max": median * 1.05, "samples": [median] * 3}


def suite_doc(suite: str, measurements: list[Any], ratios: list[Any] = (),  # type: ignore[assignment]
              verdicts: list[str] = ()) -> dict[str, Any]:  # type: ignore[assignment]
    return {"schema": "torchgpu.bench/2", "suite": suite, "quick": False,
            "devices": [{"spec": "cpu", "name": "AMD EPYC"},
                        {"spec": "cuda:0", "name": "NVIDIA H100 80GB HBM3"}],
            "device_names": ["AMD EPYC", "NVIDIA H100 80GB HBM3"], "torch": "2.11.0",
            "git": "abc123", "threads": 1, "measurements": list(measurements),
            "ratios": list(ratios), "verdicts": list(verdicts), "notes": [], "plots": [],
            "config": {}}


def fake_results(root: Path) -> Path:
    results = root / "h100-sxm-80gb"

    def put(rel: str, data: Any) -> None:
        path = results / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data))

    put("transfer/results.json", suite_doc("transfer", [
        measurement("H2D pageable cuda:0 256 MiB", 20.0, "GB/s", size_mib=256),
        measurement("H2D pinned cuda:0 4 MiB", 30.0, "GB/s", size_mib=4),
        measurement("H2D pinned cuda:0 256 MiB", 52.5, "GB/s", size_mib=256),
        measurement("H2D pinned non_blocking cuda:0 256 MiB", 53.0, "GB/s", size_mib=256),
        measurement("copy hidden by Prefetcher cuda:0", 0.93, "fraction")],
        verdicts=["H2D pinned vs pageable: 2.6x the bandwidth: claim holds"]))
    put("resnet50-step/results.json", suite_doc("resnet50-step", [], [
        ratio("raw loop fp32", "raw loop bf16", 1.7),
        ratio("raw loop bf16", "raw loop bf16 channels_last", 1.35),
        ratio("torchgpu loop fp32", "raw loop fp32", 1.01),
        ratio("torchgpu loop bf16", "raw loop bf16", 1.03)]))
    put("memory/estimate.json", {"goal": 0.15, "rows": [
        {"model": "resnet50", "precision": "fp32", "input": [64, 3, 128, 128],
         "estimated_bytes": 110, "measured_bytes": 100, "error": 0.10, "within_goal": True},
        {"model": "transformer", "precision": "bf16", "input": [16, 256],
         "estimated_bytes": 80, "measured_bytes": 100, "error": -0.20, "within_goal": False},
    ]})
    for name, speed in (("train-fp32", 1000.0), ("train-bf16", 2200.0)):
        put(f"train/{name}/summary.json", {
            "strategy": "single", "precision": name[6:], "batch_size": 256, "world_size": 1,
            "throughput_samples_per_s": speed, "devices": [
                {"peak_memory_bytes": 9 * GIB, "estimated_peak_bytes": 8 * GIB}]})
    put("kit/steps-bench.json", [
        {"name": "bench-transfer", "part": "bench", "status": "pass", "rc": 0, "seconds": 9.5,
         "budget_s": 20, "command": "python3 -m torchgpu bench transfer", "tail": "ok"},
        {"name": "bench-overhead", "part": "bench", "status": "fail", "rc": 1,
         "seconds": 3.0, "budget_s": 20, "command": "python3 -m torchgpu bench overhead",
         "problem": "exit code 1", "tail": "Traceback: boom"}])
    return results


def test_summary_of_fake_results(tmp_path: Path) -> None:
    results = fake_results(tmp_path)
    multi = [("multi-dp-ddp", "python3 -m torchgpu bench dp-ddp --device cuda:0,cuda:1", "")]
    doc = summary.write(results, multi=multi)
    figures = {f["key"]: f for f in doc["figures"]}
    assert figures["pinned_h2d_gbps"]["value"] == 52.5  # the largest size, blocking
    assert figures["prefetch_hidden_share"]["met"] is True
    assert figures["bf16_vs_fp32_resnet50"]["value"] == 1.7
    assert figures["bf16_vs_fp32_resnet50"]["met"] is False
    assert "2.20x the samples/s" in figures["bf16_vs_fp32_resnet50"]["detail"]
    assert "channels-last model: 1.35x faster" in figures["bf16_vs_fp32_resnet50"]["detail"]
    assert figures["loop_overhead_resnet50"]["met"] is True
    assert figures["memory_estimate_error"]["value"] == -0.20  # the worst model
    assert figures["memory_estimate_error"]["met"] is False
    assert doc["counts"] == {"pass": 1, "fail": 1, "needs 2 GPUs": 1}
    assert doc["claims"][0]["verdict"].endswith("claim holds")
    assert doc["needs_2_gpus"][0]["command"].endswith("cuda:0,cuda:1")
    assert doc["device_name"] == "NVIDIA H100 80GB HBM3"
    assert json.loads((results / "summary.json").read_text())["schema"] == summary.SCHEMA
    md = (results / "summary.md").read_text()
    assert "| share of copy time the Prefetcher hides | 93% | >= 90% | met |" in md
    assert "| estimate_memory vs max_memory_allocated (worst model) | -20.0% |" in md
    assert "## bench-overhead: exit code 1" in md and "Traceback: boom" in md
    assert "multi-dp-ddp: `python3 -m torchgpu bench dp-ddp" in md


def test_summary_says_what_is_missing(tmp_path: Path) -> None:
    doc = summary.build(tmp_path / "empty-gpu")
    for figure in doc["figures"]:
        assert figure["value"] is None and figure["missing"].startswith("run PART=")
    assert "not measured (run PART=bench" in summary.render(doc)


def test_readme_renderer_puts_the_gpu_check_beside_the_cpu_rows(tmp_path: Path) -> None:
    results = fake_results(tmp_path)
    summary.write(results)
    cpu = tmp_path / "cpu-2c-test" / "overhead"
    cpu.mkdir(parents=True)
    (cpu / "results.json").write_text(json.dumps({**suite_doc("overhead", [
        measurement("raw loop (tiny)", 0.5, "s")]), "devices": [{"spec": "cpu",
                                                              "name": "AMD EPYC"}]}))
    text = summarize.render(tmp_path)
    assert "### GPU check: h100-sxm-80gb" in text
    assert "| share of copy time the Prefetcher hides | 93% | >= 90% | met |" in text
    assert "[summary.md](" in text
    assert "cpu-2c-test" in text  # the CPU suite rows are still there
    assert text.index("GPU check") < text.index("### overhead")


def test_check_functions_read_the_runs_outputs(tmp_path: Path) -> None:
    run = tmp_path / "train-oom-backoff"
    run.mkdir()
    log = tmp_path / "log"
    (run / "summary.json").write_text(json.dumps({"steps": 3, "oom_backoffs": [],
                                                  "throughput_samples_per_s": 5.0}))
    assert "no OOM back-off" in (kit.check_oom_backoff(run, log, CTX) or "")
    (run / "summary.json").write_text(json.dumps({"steps": 3, "oom_backoffs": [{"to": 4}],
                                                  "throughput_samples_per_s": 5.0}))
    assert kit.check_oom_backoff(run, log, CTX) is None
    (run / "summary.json").write_text(json.dumps({"batch_size": 6000,
                                                  "config": {"data_size": 9000}}))
    assert "hit the data" in (kit.check_auto_batch(run, log, CTX) or "")
    (run / "summary.json").write_text(json.dumps({"batch_size": 1400,
                                                  "config": {"data_size": 9000}}))
    assert kit.check_auto_batch(run, log, CTX) is None


def cpu_ctx(tmp_path: Path) -> steps.Ctx:
    return steps.Ctx(device="cpu", py=sys.executable, repo=REPO, results=str(tmp_path),
                     scratch=str(tmp_path / "scratch"))


def test_a_step_past_its_budget_is_stopped_with_its_stacks(tmp_path: Path) -> None:
    step = steps.Step("sleepy", "bench", 1, ("{py}", "-c", "import time\n"
                                              "print('started')\ntime.sleep(30)"))
    record = kit.run_step(step, cpu_ctx(tmp_path), tmp_path, timeout_s=3)
    assert record["status"] == "timeout" and record["rc"] is None
    assert record["seconds"] < 3 + kit.DUMP_WAIT_S + kit.INT_WAIT_S
    log = (tmp_path / "kit" / "logs" / "sleepy.log").read_text()
    assert "started" in log  # unbuffered: what it printed is there
    assert "the stacks of pid" in log and 'File "<string>", line 3' in log  # where it hung
    assert "KeyboardInterrupt" in log  # then SIGINT


def test_a_stopped_pytest_step_still_writes_its_junit_xml(tmp_path: Path) -> None:
    """A tests step cut off at its limit keeps its results: -v lines in the log as tests
    end, and the junit XML pytest writes when SIGINT ends its session."""
    tests = tmp_path / "t"
    tests.mkdir()
    (tests / "test_x.py").write_text("import time\n\ndef test_quick():\n    pass\n\n"
                                     "def test_hangs():\n    time.sleep(60)\n")
    step = steps.Step("tests-x", "tests", 1, ("{py}", "-m", "pytest", "-v", "-p",
                      "no:cacheprovider", "-p", "no:xdist", "--rootdir", str(tests),
                      "--junitxml", str(tmp_path / "x.xml"), str(tests)))
    record = kit.run_step(step, cpu_ctx(tmp_path), tmp_path, timeout_s=8)
    assert record["status"] == "timeout"
    log = (tmp_path / "kit" / "logs" / "tests-x.log").read_text()
    assert "test_quick PASSED" in log
    xml = (tmp_path / "x.xml").read_text()
    assert 'name="test_quick"' in xml


def test_the_deadline_stops_starting_steps(tmp_path: Path) -> None:
    quick = steps.Step("quick", "bench", 5, ("{py}", "-c", "print('hi')"), expect_s=2)
    late = steps.Step("late", "bench", 5, ("{py}", "-c", "print('late')"), expect_s=2)
    ticks = iter([0.0, 0.0, 100.0])  # deadline set, first step starts, then time is up
    plan = steps.Plan((quick, late), deadline_s=steps.RESERVE_S + steps.STOP_GRACE_S + 20)
    seen: list[int] = []
    records = kit.run_plan(plan, cpu_ctx(tmp_path), tmp_path, kit.Machine("GPU", None, 1),
                           clock=lambda: next(ticks),
                           after_step=lambda done: seen.append(len(done)))
    assert [r["status"] for r in records] == ["pass", "not run"]
    assert "out of time" in records[1]["problem"]
    assert seen == [1, 2]  # the summary and archive are refreshed after every step
    saved = json.loads((tmp_path / "kit" / "steps-bench.json").read_text())
    assert [r["name"] for r in saved] == ["quick", "late"]


def test_the_deadline_counts_from_the_kits_start(tmp_path: Path) -> None:
    quick = steps.Step("quick", "bench", 5, ("{py}", "-c", "print('hi')"), expect_s=2)
    plan = steps.Plan((quick,), deadline_s=100)
    records = kit.run_plan(plan, cpu_ctx(tmp_path), tmp_path, kit.Machine("GPU", None, 1),
                           clock=lambda: 1000.0, started=1000.0 - 90)
    assert records[0]["status"] == "not run" and "out of time" in records[0]["problem"]


def test_multi_on_one_gpu_is_listed_as_needing_two(tmp_path: Path) -> None:
    plan = steps.make_plan("multi")
    records = kit.run_plan(plan, steps.Ctx(repo=REPO, results=str(tmp_path)), tmp_path,
                           kit.Machine("NVIDIA H100 80GB HBM3", 80 * GIB, 1))
    assert {r["status"] for r in records} == {"needs 2 GPUs"}
    doc = summary.write(tmp_path, multi=[(s.name, "cmd", "") for s in plan.steps])
    assert doc["counts"] == {"needs 2 GPUs": len(plan.steps)}
    assert len(doc["needs_2_gpus"]) == len(plan.steps)


def test_json_steps_read_stdout_only(tmp_path: Path) -> None:
    """A warning on stderr cannot break the JSON a devices/env step prints."""
    code = ("import json, sys; print('UserWarning: something', file=sys.stderr); "
            "print(json.dumps({{'devices': [], 'nvml': {{}}}}))")  # {{ }}: a template
    step = steps.Step("devices", "train", 20, ("{py}", "-c", code), check="devices",
                      json_stdout=True)
    record = kit.run_step(step, cpu_ctx(tmp_path), tmp_path, timeout_s=20)
    assert record["status"] == "pass", record
    assert "UserWarning" in (tmp_path / "kit" / "logs" / "devices.log").read_text()
    assert record["stdout"] == "kit/logs/devices.json"


def test_big_train_outputs_are_gzipped_or_named(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(kit, "COPY_MAX_BYTES", 4096)
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text("{}")
    (run / "memory_snapshot.pickle").write_bytes(b"frame " * 10_000)  # compresses
    (run / "model.safetensors").write_bytes(os.urandom(8192))  # neither small nor text
    (run / "memory_snapshot.html").write_bytes(os.urandom(20_000))  # too big even gzipped
    left = kit.collect_train(run, tmp_path / "dest")
    names = sorted(p.name for p in (tmp_path / "dest").iterdir())
    assert names == ["memory_snapshot.pickle.gz", "summary.json"]
    assert [x.split(" ")[0] for x in left] == ["memory_snapshot.html", "model.safetensors"]


def test_kit_runs_cheap_steps_for_real_on_the_cpu(tmp_path: Path) -> None:
    """The smoke test: the driver, a real step, the records, the summary and the archive."""
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    done = subprocess.run(
        [sys.executable, str(KIT / "kit.py"), "--device", "cpu", "--part", "train",
         "--only", "env,devices", "--tag", "cpu-smoke", "--results", str(tmp_path / "res"),
         "--scratch", str(tmp_path / "scratch")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    results = tmp_path / "res" / "cpu-smoke"
    records = json.loads((results / "kit" / "steps-train.json").read_text())
    assert [(r["name"], r["status"]) for r in records] == [("devices", "pass"),
                                                            ("env", "pass")]
    assert json.loads((results / "kit" / "logs" / "env.json").read_text())["versions"]["torch"]
    doc = json.loads((results / "summary.json").read_text())
    assert doc["counts"]["pass"] == 2 and doc["needs_2_gpus"]
    assert doc["torch"]  # from the kit's own machine.json (and git where .git exists)
    assert doc["git"] or not (REPO / ".git").exists()
    assert "torch ?" not in (results / "summary.md").read_text()
    with tarfile.open(tmp_path / "out" / "gpu-cpu-smoke-train.tar.gz") as tar:
        assert "cpu-smoke/summary.md" in tar.getnames()


def test_kit_refuses_a_machine_without_a_gpu(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(kit, "detect", lambda py: kit.Machine(None, None, 0))
    assert kit.main(["--part", "bench", "--results", str(tmp_path)]) == 2
    assert not any(tmp_path.iterdir())


def test_device_marker_selects_the_run_device_tests_and_cuda_skips_without_a_gpu() -> None:
    """`-m device` picks exactly the tests taking `run_device`; TORCHGPU_TEST_DEVICE=cuda
    moves them to the GPU, and says so where there is none."""
    import torch

    target = "tests/gpu/test_on_device.py"
    expected = (REPO / target).read_text().count("(run_device: torch.device")
    env = {**os.environ, "TORCHGPU_TEST_DEVICE": "cuda"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           "-p", "no:xdist", "-m", "device", target, "tests/unit/test_oom.py"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    if torch.cuda.is_available():
        assert f"{expected} passed" in done.stdout
    else:
        assert f"{expected} skipped" in done.stdout
        assert "TORCHGPU_TEST_DEVICE=cuda but no CUDA GPU is visible" in done.stdout
    assert "deselected" in done.stdout  # test_oom.py takes no device: not selected


def test_a_train_step_is_collected_and_checked(tmp_path: Path) -> None:
    """A real (small) `torchgpu train` run through the kit: its small files are copied into
    the results, and the train check reads the summary it wrote."""
    step = steps.Step("train-housing", "train", 120, steps.torchgpu(
        "train", "--example", "housing", "--device", "{dev}", "--epochs", "1",
        "--data-size", "64", "--progress", "plain", "--out", "{scratch}/{name}"),
        outputs="train", check="train")
    ctx = steps.Ctx(device="cpu", py=sys.executable, repo=REPO, results=str(tmp_path / "res"),
                    scratch=str(tmp_path / "scratch"))
    record = kit.run_step(step, ctx, tmp_path / "res", timeout_s=120)
    assert record["status"] == "pass", record
    copied = tmp_path / "res" / "train" / "train-housing"
    assert json.loads((copied / "summary.json").read_text())["steps"] > 0
    assert (tmp_path / "scratch" / "train-housing" / "summary.json").exists()


def test_an_interrupted_kit_stops_its_step_and_summarises_what_ran(tmp_path: Path) -> None:
    """SIGTERM to the kit (the device call ending): the running step's group is stopped,
    recorded as interrupted, and the summary and archive are written; exit 130."""
    import signal
    import time

    driver = tmp_path / "driver.py"
    driver.write_text(f"""
import sys
sys.path.insert(0, {str(KIT)!r})
import kit, steps
quick = steps.Step("quick", "bench", 30, ("{{py}}", "-c", "print('hi')"), expect_s=1)
sleepy = steps.Step("sleepy", "bench", 60, ("{{py}}", "-c", "import time; time.sleep(60)"),
                    expect_s=1)
kit.plan_mod.make_plan = lambda part, only: steps.Plan((quick, sleepy), 570, ("bench",))
sys.exit(kit.main(["--device", "cpu", "--part", "bench", "--tag", "cpu-int",
                   "--results", {str(tmp_path / "res")!r}, "--out", {str(tmp_path / "out")!r},
                   "--scratch", {str(tmp_path / "scratch")!r}]))
""")
    proc = subprocess.Popen([sys.executable, str(driver)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    results = tmp_path / "res" / "cpu-int"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (results / "kit" / "logs" / "sleepy.log").exists():
        time.sleep(0.2)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    records = json.loads((results / "kit" / "steps-bench.json").read_text())
    assert [(r["name"], r["status"]) for r in records] == [("quick", "pass"),
                                                            ("sleepy", "interrupted")]
    doc = json.loads((results / "summary.json").read_text())
    assert doc["failures"][0]["name"] == "sleepy"
    with tarfile.open(tmp_path / "out" / "gpu-cpu-int-bench.tar.gz") as tar:
        assert "cpu-int/kit/logs/sleepy.log" in tar.getnames()
