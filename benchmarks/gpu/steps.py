"""Every step of the GPU check, as data: one line per step in :data:`STEPS`.

A step is a command template, the part it belongs to, a time budget and what it needs.
Templates hold ``{placeholders}`` filled from :class:`Ctx` when the plan is made, so the
dry run prints exactly the commands a real run starts, and the CI test can parse each
``torchgpu`` command with the real argument parsers.

Placeholders: ``{py}`` the Python interpreter, ``{dev}`` the device kind (``cuda`` or
``cpu``), ``{dev0}`` one device (``cuda:0`` or ``cpu``), ``{results}`` the results
directory of this GPU (``benchmarks/results/<gpu-tag>``), ``{scratch}`` the directory for
bulky run outputs (``runs/gpu-kit/<gpu-tag>``, not packed), ``{name}`` the step's name,
``{threads}`` CPU threads for CPU rows. An argument that is exactly ``{cuda_test_files}``
becomes the CPU suite's test files that mention CUDA (see :func:`cuda_test_files`).

Adding a step is one line.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PARTS = ("tests", "bench", "lm", "train", "multi")  # lm: the GPT-2 step and the data-wait run
ONE_GPU_PARTS = ("tests", "bench", "lm", "train")  # PART=all
# Selections across the parts: `default` (what benchmarks/gpu.sh runs with no PART) is
# the figures we know least about first, in :data:`DEFAULT_STEPS`' order, within
# DEFAULT_DEADLINE_S; `rest` is every other one-GPU step, for a device call with time
# left; `all` is every one-GPU step by priority within ALL_DEADLINE_S.
SELECTIONS = ("default", "rest", "all")
# PART=all must end within 9 minutes on one H100 (540 s), counted from the kit's start.
# Its steps' budgets add up to far more (each part fills most of a device call on its
# own), so `all` runs the steps by priority and skips, with a note, those whose expected
# time no longer fits: run the part itself for them.
ALL_DEADLINE_S = 540
# PART=default must end within 8 minutes of one device call (600 s: the machine's start
# and the archive's transfer take the rest), counted from the kit's start (GPU detection,
# ~5-10 s, included). Its steps run in this order, what this engine has never shown on a
# GPU first; each keeps its own budget as its limit, and one starts only when its expected
# time still fits. Expected, one H100: detection ~8, tests-gpu ~70, gpt2-step ~120,
# bench-transfer ~20, bench-resnet50-step ~35, estimate-memory ~30, train-auto-batch ~45,
# train-oom-backoff ~40: ~370 s of the 454 s a step may use (480 - RESERVE_S -
# STOP_GRACE_S), then train-fp32/bf16 (~30 s each) in what is left.
DEFAULT_DEADLINE_S = 480
DEFAULT_STEPS = ("tests-gpu", "gpt2-step", "bench-transfer", "bench-resnet50-step",
                 "estimate-memory", "train-auto-batch", "train-oom-backoff", "train-data-wait",
                 "train-fp32", "train-bf16")
# PART=rest: one device call (PART_DEADLINE_S) by priority; its budgets add up to more,
# its expected times (~425 s) fit.
# One part per device call: the call's limit is 600 s; 570 s leaves the tool's start-up
# and the archive's transfer some room. Step budgets are scaled up to fill it.
PART_DEADLINE_S = 570
RESERVE_S = 10  # kept back from the deadline for the summary and the archive
# A step past its limit gets its stack dumped, SIGINT (pytest ends its session and writes
# its junit XML; `torchgpu train` saves and writes its summary), SIGTERM 10 s later,
# SIGKILL 5 s after that: its limit ends this long before the deadline.
STOP_GRACE_S = 16
# Each Python process that touches the GPU pays ~5-10 s before its first kernel: the
# interpreter, `import torch` of a CUDA build (~2-4 s), CUDA's context (~1-3 s), and
# cuBLAS/cuDNN loading on first use (~1-2 s). Estimates below include it once per process.
START_S = 8


@dataclass(frozen=True)
class Ctx:
    """What the templates are filled with (see the module docstring)."""

    device: str = "cuda"
    results: str = "benchmarks/results/<gpu-tag>"
    scratch: str = "runs/gpu-kit/<gpu-tag>"
    py: str = "python3"
    # this machine's cores, at most 16 (bench --threads is capped per core where it runs)
    threads: int = field(default_factory=lambda: min(os.cpu_count() or 1, 16))
    repo: Path = Path(".")

    @property
    def dev0(self) -> str:
        return "cuda:0" if self.device == "cuda" else self.device


@dataclass(frozen=True)
class Step:
    """One command of the check.

    ``budget_s``: its time limit in a run of its part alone, where the kit scales every
    budget up to fill the part's deadline (see ``kit.step_limit``); the run is stopped past
    its limit and recorded as a timeout. ``expect_s``: what it should take on one H100
    (the estimate in the comment above it): PART=all starts a step only when that much time
    is left. ``priority``: 1 runs first (the figures the issue asks for, and the proof that
    the GPU paths work), 3 last (the long sweeps); PART=all runs in this order.
    ``needs``: ``"cuda"`` (pointless without a GPU), ``"2gpus"`` (listed as "needs 2 GPUs"
    with its command on a machine with fewer), or None. ``ok_rcs``: exit codes that mean
    the command worked (``doctor`` exits 1 when it reports findings). ``env``: variables
    added for the command. ``outputs``: ``"train"`` when the command is a ``torchgpu train``
    run writing to ``{scratch}/{name}`` (its small files are copied into
    ``{results}/train/{name}``). ``check``: what the output must show beyond the exit
    code, a name in ``kit.CHECKS``. ``json_stdout``: the command prints JSON; its stdout
    goes to ``kit/logs/<name>.json`` apart from its stderr (a warning cannot break it).
    """

    name: str
    part: str
    budget_s: int
    argv: tuple[str, ...]
    expect_s: int = 0
    priority: int = 2
    needs: str | None = None
    ok_rcs: tuple[int, ...] = (0,)
    env: tuple[tuple[str, str], ...] = ()
    outputs: str | None = None
    check: str | None = None
    note: str = ""
    json_stdout: bool = False

    def command(self, ctx: Ctx) -> list[str]:
        """The argv this step runs under ``ctx``."""
        values = {"py": ctx.py, "dev": ctx.device, "dev0": ctx.dev0, "results": ctx.results,
                  "scratch": ctx.scratch, "name": self.name, "threads": str(ctx.threads)}
        argv: list[str] = []
        for arg in self.argv:
            if arg == "{cuda_test_files}":
                argv += cuda_test_files(ctx.repo)
            else:
                argv.append(arg.format(**values))
        return argv

    def environment(self, ctx: Ctx) -> dict[str, str]:
        values = {"dev": ctx.device, "dev0": ctx.dev0}
        return {key: value.format(**values) for key, value in self.env}


def torchgpu(*args: str) -> tuple[str, ...]:
    return ("{py}", "-m", "torchgpu", *args)


def bench(suite: str, *flags: str, device: str = "{dev0}", out: str = "") -> tuple[str, ...]:
    """``torchgpu bench SUITE`` at full size into ``{results}/<out or suite>``."""
    return torchgpu("bench", suite, "--device", device, *flags,
                    "--out", "{results}/" + (out or suite), "--force")


# The ResNet-50 example's images are 128x128: ~33 MB of activations per sample in fp32.
def train(*flags: str, device: str | None = "{dev}") -> tuple[str, ...]:
    """``torchgpu train --example resnet50`` writing to ``{scratch}/{name}``."""
    where = ("--device", device) if device else ()
    return torchgpu("train", "--example", "resnet50", *where, "--epochs", "1",
                    "--progress", "plain", *flags, "--out", "{scratch}/{name}")


def script(path: str, *args: str) -> tuple[str, ...]:
    return ("{py}", path, *args)


# pytest-timeout's limit per test: well below the tests steps' budgets, so a hung test
# fails alone (with its stack) and the step goes on. The longest CPU-suite test took 53 s
# on a loaded 2-core box (tests/unit/test_resume.py's SIGTERM test, mostly subprocess
# start-ups), about 15 s on a 16-core one.
TEST_TIMEOUT_S = 90
# -v: one line per test as it ends (PYTHONUNBUFFERED=1 writes it at once), so a step
# stopped at its budget still leaves every result so far in its log; the kit stops pytest
# with SIGINT first, so it ends its session and writes the junit XML too.
PYTEST = ("{py}", "-m", "pytest", "-v", "-p", "no:cacheprovider", "--durations", "25",
          "--timeout", str(TEST_TIMEOUT_S))
TWO = "cuda:0,cuda:1"

STEPS: tuple[Step, ...] = (
    # -- tests --------------------------------------------------------------------------
    # Every @pytest.mark.gpu test (tests/gpu and 5 elsewhere) and every test taking the
    # `run_device` fixture (tests/conftest.py; `-m device`), which TORCHGPU_TEST_DEVICE=cuda
    # moves onto the GPU. ~100 tests of small models: collecting all of tests/ ~10 s,
    # one CUDA process ~8 s, the tests ~30-60 s (the slowest: a train/resume subprocess
    # each ~8 s, the ResNet-50 ones ~2 s). Expect ~70 s.
    Step("tests-gpu", "tests", 180, (*PYTEST, "-m", "gpu or device",
         "--junitxml", "{results}/tests/gpu.xml", "tests"), expect_s=70, priority=1,
         needs="cuda", env=(("TORCHGPU_TEST_DEVICE", "{dev}"),)),
    # The rest of the CPU suite's files that mention CUDA (~1000 tests; gpu- and
    # device-marked ones excluded: the step above ran them). Here they take ~340 s of test
    # time on 2 loaded cores; on 16 cores with 8 workers, each importing a CUDA build of
    # torch (~10 s), ~60-120 s, bounded below by the slowest test (~15-50 s).
    Step("tests-cuda-aware", "tests", 360, (*PYTEST, "-n", "8", "--dist", "loadgroup",
         "-m", "not gpu and not device", "--junitxml", "{results}/tests/cuda-aware.xml",
         "{cuda_test_files}"), expect_s=120, priority=3, needs="cuda"),
    # -- bench: the seed suites at full size on one GPU (both stages on cuda:0: streams) --
    # The figures the issue quotes first: pinned H2D GB/s and the share the Prefetcher
    # hides. 3 sizes (4-256 MiB) x pageable/pinned x blocking/non_blocking x both ways,
    # 12 rounds (256 MiB pageable ~25 ms, pinned ~5 ms), pinning 256 MiB ~0.1 s, the
    # Prefetcher's 16 x 64 MiB batches: ~5-10 s after start-up.
    Step("bench-transfer", "bench", 45, bench("transfer"), expect_s=20, priority=1),
    # bf16 vs fp32, channels-last in bf16, and the loop's overhead at ResNet-50 224px,
    # batch 128: 6 variants x 8 rounds x 5 steps = 240 steps. On the H200 the 4-variant
    # version took 24.5 s (63 ms a step in fp32/TF32, 58 ms in bf16); 6 variants: ~35 s,
    # plus 6 models and 5 pinned batches (77 MB each), cuDNN's first-call heuristics.
    Step("bench-resnet50-step", "bench", 75, script(
        "benchmarks/gpu/resnet_step.py", "--device", "{dev0}",
        "--out", "{results}/resnet50-step"), expect_s=35, priority=1),
    # -- lm: GPT-2 small (transformers, 124M) through torchgpu's loop vs a raw loop, eager
    #    and compiled, bf16, with host syncs per optimizer step counted. --
    # Run once by hand on an H200 (torch 2.11, transformers 5.17, sdpa attention): steps
    # of 16 x 1024 tokens took 103 ms eager, 50 ms compiled; the first compile 26 s, the
    # other two compiled variants ~0.5 s (dynamo's and inductor's caches); 25 GB peak;
    # 96 s in all, start-up included. Per mode: 3 variants x (first call + 1 warm-up + 5
    # rounds + the sync count) x 10 steps = 240 steps. An H100 is ~1.2-1.5x slower and may
    # compile for longer: expect ~120 s. The script skips the compiled mode when less than
    # 100 s of its 190 s are left after the eager one, and writes its results after each
    # mode (a stop during the compile keeps the eager rows).
    Step("gpt2-step", "lm", 200, script(
        "benchmarks/gpu/gpt2_step.py", "--device", "{dev0}", "--time-limit", "190",
        "--out", "{results}/gpt2-step"), expect_s=120, priority=1),
    # fp32 and bf16 square products up to 8192 on the GPU (each sample >= 2^33 MACs: ~0.3 ms
    # fp32 at ~50 TFLOP/s) and up to 2048 on the CPU with 16 threads (~35 ms a sample),
    # 12 rounds: a few seconds.
    Step("bench-matmul", "bench", 40, bench("matmul", "--threads", "{threads}"),
         expect_s=20),
    # ResNet-50 (18 layers) at batch 32, 128px, 6 checkpoint settings x 12 rounds of one
    # step (~30-60 ms): ~5 s.
    Step("bench-checkpointing", "bench", 40, bench("checkpointing"), expect_s=20),
    # ResNet-50 at batch 64, 64px as 1-8 micro-batches, 4 variants x 12 rounds: ~5 s.
    Step("bench-accumulation", "bench", 40, bench("accumulation"), expect_s=20),
    # The MLPs' loops (housing 13-16-32-1, 4x512), raw vs torchgpu, plus Lightning Fabric
    # and Accelerate (both installed on the box): launch-bound steps of ~0.1-0.3 ms,
    # epochs of a few hundred steps, 12 rounds: ~10-20 s.
    # Ran past this limit on an H200 (2026-11-27, tiny and medium at full size); the bench
    # part's budgets fill one device call, so it stays (a device session with time left
    # can run `torchgpu bench overhead --device cuda:0` alone).
    Step("bench-overhead", "bench", 60, bench("overhead"), expect_s=25),
    # Seed 002's experiment on one GPU twice: ResNet-50, batch 120 at 128px, 3 batches a
    # run; single / model split / pipeline at split 20 (6 chunks), 12 rounds: ~3 x 0.4 s
    # x 12 = ~15 s.
    Step("bench-parallel", "bench", 60, bench("parallel"), expect_s=25),
    # The long one: 10 variants x 12 rounds x 3 batches, the 9 split sizes giving 232
    # micro-batches per batch: ~8350 ResNet-50 micro-batch passes (fwd+bwd), 4320 at batch 1.
    # Eager small-batch ResNet-50 is launch-bound at ~8-15 ms a pass (~500 kernels + the
    # pipeline's Python per micro-batch): ~70-125 s, plus start-up.
    Step("bench-split-sweep", "bench", 180, bench("split-sweep"), expect_s=120, priority=3),
    # -- train: the example in fp32 and bf16, the batch-size search against the real
    #    memory, a real OOM and its back-off, the allocator snapshot, the estimator, and
    #    the inventory verbs on a real NVML. --
    # `torchgpu train --example resnet50`, 3072 images at 128px (2048 to train, 8 steps of
    # 256; 1024 held out): start-up ~8 s, 0.6 GB of random images ~1-2 s, the auto
    # strategy's planner and --estimate-memory on fake tensors ~3-6 s, 2048 images at
    # ~3000-4000 img/s (fp32/TF32 at 128px) ~1 s, eval, a 100 MB checkpoint, the loss
    # plot: ~20-30 s; bf16 a little less.
    Step("train-fp32", "train", 70, train("--precision", "fp32", "--data-size", "3072",
         "--batch-size", "256", "--estimate-memory"), expect_s=30, priority=1,
         outputs="train", check="train"),
    Step("train-bf16", "train", 70, train("--precision", "bf16", "--data-size", "3072",
         "--batch-size", "256", "--estimate-memory"), expect_s=30, priority=1,
         outputs="train", check="train"),
    # ResNet-50, fp32, 6 models on meta tensors then for real (3 Adam steps each; the
    # biggest ResNet-50 at batch 64, 128px): ~15-25 s.
    Step("estimate-memory", "train", 60, script(
        "benchmarks/gpu/memory_check.py", "--device", "{dev0}",
        "--json", "{results}/memory/estimate.json"), expect_s=30, priority=1, needs="cuda",
         check="estimate"),
    # A real OOM: 8192 images of 128px need ~270 GB in fp32, more than an H100 (80 GB) or
    # an H200 (141 GB) holds. `--strategy single` keeps the planner out (under the default
    # `auto` it re-plans the batch as micro-batches that fit, and nothing runs out of
    # memory), `--precision fp32` keeps the activations at their largest, and nothing sets
    # --accumulate or --effective-batch-size, so the first step asks for all 8192
    # (tests/unit/test_gpu_kit.py checks that the config reaches the loop unchanged).
    # 2.4 GB of random images ~4 s; each failed try stops within its forward (<1 s); the
    # back-off halves to 4096, 2048, 1024 (~3 tries); then 8192 images in fitting
    # micro-batches ~3 s and eval of 4096: ~25-40 s.
    Step("train-oom-backoff", "train", 90, train(
        "--strategy", "single", "--precision", "fp32", "--batch-size", "8192",
        "--data-size", "12288"), expect_s=40, priority=1, outputs="train",
         check="oom_backoff", needs="cuda",
         note="8192 images of 128x128 need ~270 GB in fp32: the first step runs out of "
              "memory and the back-off halves the micro-batch until it fits"),
    # Does --num-workers auto keep the GPU fed when __getitem__ decodes? JPEG decode +
    # crop + flip of 160px images (benchmarks/gpu/decode_data.py; ~0.3-0.5 ms an image on
    # one core, so 8 workers give ~15-25k images/s) into ResNet-50 bf16 at 128px, batch
    # 256 (~3-5k images/s on an H100): 3 epochs of 12288 images (~3-4 s each; the workers'
    # start at each epoch is in the wait), 4096 held out. summary.json's data_wait_share is
    # the figure (goal < 5 %); start-up ~10 s, planning ~5 s: ~35-45 s.
    Step("train-data-wait", "lm", 90, torchgpu(
        "train", "--model", "benchmarks/gpu/decode_data.py:model", "--data",
        "benchmarks/gpu/decode_data.py:data", "--loss", "cross_entropy", "--device", "{dev}",
        "--precision", "bf16", "--batch-size", "256", "--num-workers", "auto", "--epochs", "3",
        "--progress", "plain", "--out", "{scratch}/{name}"), expect_s=40, outputs="train",
         check="data_wait", needs="cuda", env=(("TORCHGPU_DECODE_IMAGES", "16384"),)),
    Step("devices", "train", 20, torchgpu("devices", "--json"), expect_s=8, priority=1,
         check="devices", json_stdout=True),
    # --batch-size auto over 9000 images (6000 to train; 1.8 GB made ~3 s), one step of
    # all 6000 (auto keeps the effective batch, so it is asked for): the search doubles
    # then bisects real fwd+bwd steps up to the memory limit (~2.5k samples on an H100,
    # ~4.5k on an H200: ~10-15 tries of ~0.2-1.5 s), then one epoch: ~30-50 s.
    Step("train-auto-batch", "train", 90, train("--batch-size", "auto", "--effective-batch-size",
         "6000", "--data-size", "9000"), expect_s=45, outputs="train", check="auto_batch",
         needs="cuda"),
    # A user's model through the same engine: the test suite's causal LM (dict batches,
    # .loss, tied embeddings) from file specs, bf16, the batch size searched on the GPU
    # (capped by the 64 samples). 6 s of CPU time here; + CUDA start-up: ~15-25 s.
    Step("train-user-model", "train", 50, torchgpu(
        "train", "--model", "tests/user_models.py:lm_factory", "--data",
        "tests/user_models.py:lm_data", "--device", "{dev}", "--precision", "bf16",
        "--batch-size", "auto", "--effective-batch-size", "64", "--epochs", "2",
        "--progress", "plain", "--out", "{scratch}/{name}"), expect_s=25, outputs="train",
         check="train", needs="cuda"),
    # The allocator's history over 2 steps of 16 (48 images: 32 to train): recorded with
    # Python stacks only (memory_snapshot.py; C++ symbolisation at dump time took minutes
    # elsewhere), dumped as pickle + HTML: ~15-25 s.
    Step("train-memory-snapshot", "train", 50, train("--data-size", "48", "--batch-size",
         "16", "--memory-snapshot"), expect_s=25, outputs="train", check="memory_snapshot",
         needs="cuda"),
    # The inventory verbs: a CUDA build's `import torch` (~2-5 s) and NVML; no CUDA context.
    Step("env", "train", 20, torchgpu("env", "--json"), expect_s=8, json_stdout=True),
    Step("doctor", "train", 20, torchgpu("doctor"), expect_s=8, ok_rcs=(0, 1),
         note="exit 1 = findings reported, which is what doctor is for"),
    # -- multi: what only 2+ GPUs can show; listed with these commands on one GPU. --
    Step("multi-dp-ddp", "multi", 115, bench("dp-ddp", device=TWO), expect_s=60,
         needs="2gpus", note="DataParallel vs NCCL DDP"),
    Step("multi-parallel", "multi", 60, bench("parallel", device=TWO, out="parallel-2gpu"),
         expect_s=25, needs="2gpus",
         note="model split and pipeline over two GPUs (the seed's speed-up)"),
    Step("multi-split-sweep", "multi", 110, bench("split-sweep", device=TWO,
         out="split-sweep-2gpu"), expect_s=90, needs="2gpus"),
    Step("multi-train-ddp", "multi", 60, train("--strategy", "ddp", "--nproc", "2",
         "--data-size", "3072", "--batch-size", "128", device="cuda"), expect_s=35,
         needs="2gpus", outputs="train", check="train"),
    Step("multi-train-dp", "multi", 50, train("--strategy", "dp", "--data-size", "3072",
         "--batch-size", "128", device="cuda"), expect_s=30, needs="2gpus",
         outputs="train", check="train"),
    Step("multi-train-model", "multi", 50, train("--strategy", "model", "--devices", TWO,
         "--data-size", "3072", "--batch-size", "128", device=None), expect_s=30,
         needs="2gpus", outputs="train", check="train"),
    Step("multi-train-pipeline", "multi", 50, train("--strategy", "pipeline", "--devices",
         TWO, "--chunks", "4", "--data-size", "3072", "--batch-size", "128", device=None),
         expect_s=30, needs="2gpus", outputs="train", check="train"),
    Step("multi-train-hang", "multi", 45, train("--strategy", "ddp", "--nproc", "2",
         "--data-size", "3072", "--batch-size", "64", "--collective-timeout", "15",
         device="cuda"), expect_s=40, needs="2gpus", ok_rcs=(1,), check="hang",
         env=(("TORCHGPU_FAULT_HANG_AT_STEP", "3"), ("TORCHGPU_FAULT_RANK", "1")),
         note="NCCL: a planted hang named by the launcher, the flight recorder's dumps under "
         "OUT/flight_recorder"),
)


def cuda_test_files(repo: Path) -> list[str]:
    """The CPU suite's test files (tests/unit, tests/cli) that mention CUDA: the code paths
    they reach branch on whether CUDA exists, so they run again where it does."""
    found = []
    for folder in ("tests/unit", "tests/cli"):
        for path in sorted((repo / folder).glob("test_*.py")):
            if path.name == "test_gpu_kit.py":  # the kit's own tests: no device in them
                continue
            if "cuda" in path.read_text(encoding="utf-8", errors="replace"):
                found.append(path.relative_to(repo).as_posix())
    return found


@dataclass(frozen=True)
class Plan:
    """The steps one kit run starts, in order, and its deadline in seconds."""

    steps: tuple[Step, ...]
    deadline_s: int
    parts: tuple[str, ...] = field(default=())
    # One part per call: the budgets are scaled up to fill the deadline. PART=all,
    # default or rest: each step keeps its budget, and one starts only when its expected
    # time still fits.
    fill: bool = True
    name: str = ""  # the selection (default, rest, all) or the part


def parts_for(part: str) -> tuple[str, ...]:
    if part in SELECTIONS:
        return ONE_GPU_PARTS
    if part not in PARTS:
        raise ValueError(f"PART={part!r}: use one of {', '.join(PARTS)}, "
                         f"{', '.join(SELECTIONS)}")
    return (part,)


def make_plan(part: str, only: Sequence[str] = (), steps: Iterable[Step] = STEPS) -> Plan:
    """The steps of ``part`` (``all`` = every one-GPU part), or only those named, in
    order of priority (listed order within one priority); ``default``: the steps of
    :data:`DEFAULT_STEPS` in that order, ``rest``: every other one-GPU step by priority."""
    parts = parts_for(part)
    chosen = sorted((s for s in steps if s.part in parts), key=lambda s: s.priority)
    if part == "default":
        by_name = {s.name: s for s in chosen}
        chosen = [by_name[n] for n in DEFAULT_STEPS if n in by_name]
    elif part == "rest":
        chosen = [s for s in chosen if s.name not in DEFAULT_STEPS]
    if only:
        known = {s.name for s in chosen}
        unknown = [n for n in only if n not in known]
        if unknown:
            raise ValueError(f"no step named {', '.join(unknown)} in PART={part}: the steps "
                             f"are {', '.join(sorted(known))}")
        chosen = [s for s in chosen if s.name in only]
    deadline = {"default": DEFAULT_DEADLINE_S, "rest": PART_DEADLINE_S,
                "all": ALL_DEADLINE_S}.get(part, PART_DEADLINE_S)
    parts = tuple(p for p in parts if any(s.part == p for s in chosen)) or parts
    return Plan(tuple(chosen), deadline, parts, fill=part not in SELECTIONS, name=part)


def multi_gpu_steps(steps: Iterable[Step] = STEPS) -> list[Step]:
    return [s for s in steps if s.needs == "2gpus"]
