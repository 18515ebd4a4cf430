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

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PARTS = ("tests", "bench", "train", "multi")
ONE_GPU_PARTS = ("tests", "bench", "train")  # PART=all
# The whole one-GPU check must end within 9 minutes on one H100 (540 s): the kit stops
# starting steps when its deadline is near, and the step budgets below add up to less.
ALL_DEADLINE_S = 540
PART_DEADLINE_S = 570  # one part per device call: the call's limit is 600 s
RESERVE_S = 15  # kept back from the deadline for the summary and the archive


@dataclass(frozen=True)
class Ctx:
    """What the templates are filled with (see the module docstring)."""

    device: str = "cuda"
    results: str = "benchmarks/results/<gpu-tag>"
    scratch: str = "runs/gpu-kit/<gpu-tag>"
    py: str = "python3"
    threads: int = 16
    repo: Path = Path(".")

    @property
    def dev0(self) -> str:
        return "cuda:0" if self.device == "cuda" else self.device


@dataclass(frozen=True)
class Step:
    """One command of the check.

    ``budget_s``: its time limit (the run is killed past it and recorded as a timeout).
    ``needs``: ``"cuda"`` (pointless without a GPU), ``"2gpus"`` (listed as "needs 2 GPUs"
    with its command on a machine with fewer), or None. ``ok_rcs``: exit codes that mean
    the command worked (``doctor`` exits 1 when it reports findings). ``env``: variables
    added for the command. ``outputs``: ``"train"`` when the command is a ``torchgpu train``
    run writing to ``{scratch}/{name}`` (its small files are copied into
    ``{results}/train/{name}``). ``check``: what the output must show beyond the exit
    code, a name in ``kit.CHECKS``.
    """

    name: str
    part: str
    budget_s: int
    argv: tuple[str, ...]
    needs: str | None = None
    ok_rcs: tuple[int, ...] = (0,)
    env: tuple[tuple[str, str], ...] = ()
    outputs: str | None = None
    check: str | None = None
    note: str = ""

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


PYTEST = ("{py}", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--timeout", "120")
TWO = "cuda:0,cuda:1"

STEPS: tuple[Step, ...] = (
    # -- tests: every @pytest.mark.gpu test, and the tests taking the `run_device` fixture
    #    (tests/conftest.py) re-run on the GPU; then the CPU suite's files that branch on
    #    CUDA, run where CUDA exists.
    Step("tests-gpu", "tests", 100, (*PYTEST, "-m", "gpu or device",
         "--junitxml", "{results}/tests/gpu.xml", "tests"),
         needs="cuda", env=(("TORCHGPU_TEST_DEVICE", "{dev}"),)),
    Step("tests-cuda-aware", "tests", 60, (*PYTEST, "-n", "8", "--dist", "loadgroup",
         "--junitxml", "{results}/tests/cuda-aware.xml", "{cuda_test_files}"), needs="cuda"),
    # -- bench: the seed suites at full size on one GPU (both stages on cuda:0: streams).
    Step("bench-matmul", "bench", 20, bench("matmul", "--threads", "{threads}")),
    Step("bench-transfer", "bench", 20, bench("transfer")),
    Step("bench-checkpointing", "bench", 20, bench("checkpointing")),
    Step("bench-accumulation", "bench", 20, bench("accumulation")),
    Step("bench-parallel", "bench", 25, bench("parallel")),
    Step("bench-split-sweep", "bench", 34, bench("split-sweep")),
    Step("bench-overhead", "bench", 20, bench("overhead")),
    Step("bench-resnet50-step", "bench", 30, script(
        "benchmarks/gpu/resnet_step.py", "--device", "{dev0}",
        "--out", "{results}/resnet50-step")),
    # -- train: the example in fp32 and bf16, the batch-size search against the real
    #    memory, a real OOM and its back-off, the allocator snapshot, the estimator, and
    #    the inventory verbs on a real NVML.
    Step("train-fp32", "train", 20, train("--precision", "fp32", "--data-size", "3072",
         "--batch-size", "256", "--estimate-memory"), outputs="train", check="train"),
    Step("train-bf16", "train", 20, train("--precision", "bf16", "--data-size", "3072",
         "--batch-size", "256", "--estimate-memory"), outputs="train", check="train"),
    Step("train-auto-batch", "train", 33, train("--batch-size", "auto", "--data-size",
         "9000"), outputs="train", check="auto_batch", needs="cuda"),
    Step("train-oom-backoff", "train", 30, train("--batch-size", "8192", "--data-size",
         "12288"), outputs="train", check="oom_backoff", needs="cuda",
         note="8192 images of 128x128 need ~270 GB in fp32: the first step runs out of "
              "memory and the back-off halves the micro-batch until it fits"),
    # A user's model through the same engine: the test suite's causal LM (dict batches,
    # .loss, tied embeddings) from file specs, bf16, the batch size searched on the GPU.
    Step("train-user-model", "train", 10, torchgpu(
        "train", "--model", "tests/user_models.py:lm_factory", "--data",
        "tests/user_models.py:lm_data", "--device", "{dev}", "--precision", "bf16",
        "--batch-size", "auto", "--effective-batch-size", "64", "--epochs", "2",
        "--progress", "plain", "--out", "{scratch}/{name}"), outputs="train", check="train",
         needs="cuda"),
    Step("train-memory-snapshot", "train", 15, train("--data-size", "96", "--batch-size",
         "16", "--memory-snapshot"), outputs="train", check="memory_snapshot", needs="cuda"),
    Step("estimate-memory", "train", 30, script(
        "benchmarks/gpu/memory_check.py", "--device", "{dev0}",
        "--json", "{results}/memory/estimate.json"), needs="cuda", check="estimate"),
    Step("devices", "train", 6, torchgpu("devices", "--json"), check="devices"),
    Step("env", "train", 6, torchgpu("env", "--json")),
    Step("doctor", "train", 6, torchgpu("doctor"), ok_rcs=(0, 1),
         note="exit 1 = findings reported, which is what doctor is for"),
    # -- multi: what only 2+ GPUs can show; listed with these commands on one GPU.
    Step("multi-dp-ddp", "multi", 120, bench("dp-ddp", device=TWO), needs="2gpus",
         note="DataParallel vs NCCL DDP"),
    Step("multi-parallel", "multi", 60, bench("parallel", device=TWO, out="parallel-2gpu"),
         needs="2gpus", note="model split and pipeline over two GPUs (the seed's speed-up)"),
    Step("multi-split-sweep", "multi", 90, bench("split-sweep", device=TWO,
         out="split-sweep-2gpu"), needs="2gpus"),
    Step("multi-train-ddp", "multi", 60, train("--strategy", "ddp", "--nproc", "2",
         "--data-size", "3072", "--batch-size", "128", device="cuda"), needs="2gpus",
         outputs="train", check="train"),
    Step("multi-train-dp", "multi", 60, train("--strategy", "dp", "--data-size", "3072",
         "--batch-size", "128", device="cuda"), needs="2gpus", outputs="train", check="train"),
    Step("multi-train-model", "multi", 60, train("--strategy", "model", "--devices", TWO,
         "--data-size", "3072", "--batch-size", "128", device=None), needs="2gpus",
         outputs="train", check="train"),
    Step("multi-train-pipeline", "multi", 60, train("--strategy", "pipeline", "--devices",
         TWO, "--chunks", "4", "--data-size", "3072", "--batch-size", "128", device=None),
         needs="2gpus", outputs="train", check="train"),
    Step("multi-train-hang", "multi", 45, train("--strategy", "ddp", "--nproc", "2",
         "--data-size", "3072", "--batch-size", "64", "--collective-timeout", "15",
         device="cuda"), needs="2gpus", ok_rcs=(1,), check="hang",
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


def parts_for(part: str) -> tuple[str, ...]:
    if part == "all":
        return ONE_GPU_PARTS
    if part not in PARTS:
        raise ValueError(f"PART={part!r}: use one of {', '.join(PARTS)} or all")
    return (part,)


def make_plan(part: str, only: Sequence[str] = (), steps: Iterable[Step] = STEPS) -> Plan:
    """The steps of ``part`` (``all`` = tests, bench and train), or only those named."""
    parts = parts_for(part)
    chosen = [s for s in steps if s.part in parts]
    if only:
        known = {s.name for s in chosen}
        unknown = [n for n in only if n not in known]
        if unknown:
            raise ValueError(f"no step named {', '.join(unknown)} in PART={part}: the steps "
                             f"are {', '.join(sorted(known))}")
        chosen = [s for s in chosen if s.name in only]
    deadline = ALL_DEADLINE_S if len(parts) > 1 else PART_DEADLINE_S
    return Plan(tuple(chosen), deadline, parts)


def multi_gpu_steps(steps: Iterable[Step] = STEPS) -> list[Step]:
    return [s for s in steps if s.needs == "2gpus"]
