"""The GPU check: run the tests, benchmarks and training runs a GPU machine can settle, one
part per device call, and leave every figure in ``benchmarks/results/<gpu-tag>/``.

    PYTHONPATH=src python3 benchmarks/gpu/kit.py --part tests|bench|train|multi|all
    PYTHONPATH=src python3 benchmarks/gpu/kit.py --dry-run         # print every command
    PYTHONPATH=src python3 benchmarks/gpu/kit.py --summary-only --tag h100-sxm-80gb

Nothing is installed: commands run as ``python3 -m torchgpu ...`` with ``PYTHONPATH=src``
and ``PYTHONUNBUFFERED=1``. Each step (:mod:`steps`) runs in its own process group with a
time limit (:func:`step_limit`: one part alone scales the budgets to fill the part's
570 s; ``all`` runs by priority within 540 s from the kit's start and skips, with a note,
what no longer fits). A step past its limit gets its stacks dumped into its log, then
SIGINT, SIGTERM and SIGKILL (:func:`stop_group`), so pytest still writes its junit XML
and ``torchgpu train`` its summary. Its exit code, time and output tail go to
``<results>/kit/steps-<part>.json`` and its whole output to ``<results>/kit/logs/``. A
failed step is recorded and the kit goes on. After every step it rewrites
``summary.json``/``summary.md`` (:mod:`summary`) from everything in the results
directory (so parts run in separate calls add up) and, when ``OUT`` is set (or
``--out``), re-packs the directory into one ``.tar.gz`` there: a call cut off midway
still returns what ran.

Exit code: 0 when every step that ran passed, 1 when one failed, 2 for bad input, 130
when the kit itself was interrupted (SIGINT/SIGTERM; what ran is still summarised).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

import pack  # noqa: E402
import steps as plan_mod  # noqa: E402
import summary as summary_mod  # noqa: E402
from steps import RESERVE_S, STOP_GRACE_S, Ctx, Plan, Step  # noqa: E402
from tag import gpu_tag  # noqa: E402

HOOKS = HERE / "hooks"  # sitecustomize: SIGUSR1 dumps every thread's stack
TAIL_CHARS = 3000  # of a step's output kept in its record
# Train outputs larger than this are gzipped into the results (allocator snapshots: pickles
# and HTML compress ~5-10x), and stay in the scratch directory, named in the step's record,
# when even that is larger. The archive takes 8 MiB a file and 15 MiB in all (pack.py).
COPY_MAX_BYTES = 4 * 2**20
COMPRESSIBLE = (".pickle", ".html", ".json", ".jsonl", ".csv", ".txt", ".log")
# stop_group's sequence; its waits add up to steps.STOP_GRACE_S.
DUMP_WAIT_S, INT_WAIT_S, TERM_WAIT_S = 1, 10, 5
MIN_START_S = 5  # a step with no estimate starts only with this much time left
FAILED = ("fail", "timeout", "interrupted")  # statuses that make the kit exit 1


class KitError(Exception):
    """Bad input or a machine the kit cannot run on: one paragraph, exit 2."""


@dataclass(frozen=True)
class Machine:
    """What the kit runs on: the GPU's name, memory and count (name None: no GPU), and
    what ``torchgpu devices --json`` said of torch and the driver when it was asked."""

    name: str | None
    total_bytes: int | None
    gpu_count: int
    torch: str | None = None
    cuda: str | None = None
    driver: str | None = None


def detect(py: str, timeout_s: float = 90) -> Machine:
    """The GPUs as ``torchgpu devices --json`` sees them (NVML first: CUDA stays
    uninitialised in this process, so the steps get the whole GPU)."""
    env = {**os.environ, "PYTHONPATH": _pythonpath()}
    try:
        done = subprocess.run([py, "-m", "torchgpu", "devices", "--json"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=timeout_s, check=False)
        data = json.loads(done.stdout)  # stdout only: a warning on stderr cannot break it
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError) as error:
        raise KitError(f"could not list the GPUs with `torchgpu devices --json` ({error}); "
                       "run it by hand to see why, or pass --tag NAME to skip detection "
                       "with --dry-run") from error
    gpus = [d for d in data.get("devices", []) if d.get("kind") == "cuda"]
    build = data.get("torch") or {}
    about = {"torch": build.get("version"), "cuda": build.get("cuda"),
             "driver": (data.get("nvml") or {}).get("driver_version")}
    if not gpus:
        return Machine(None, None, 0, **about)
    return Machine(gpus[0].get("name"), gpus[0].get("total_bytes"), len(gpus), **about)


def git_revision() -> str | None:
    """``$GIT_REV`` (the device machine gets a copy of the working tree without .git: pass
    it there as ``GIT_REV=$(git describe --always --dirty)``), else ``git describe`` here,
    read-only (GIT_OPTIONAL_LOCKS=0: someone may be committing in this checkout)."""
    given = os.environ.get("GIT_REV", "").strip()
    if given:
        return given
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}
    try:
        done = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"],
                              capture_output=True, text=True, timeout=10, env=env, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def torch_version() -> str | None:
    """torch's version from its metadata (this process never imports torch)."""
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def write_machine(results: Path, machine: Machine, device: str, part: str) -> None:
    """``kit/machine.json``: what ran the kit, so the summary names the GPU, torch and the
    git revision even before any suite has written its own."""
    path = results / "kit" / "machine.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"gpu": machine.name, "total_bytes": machine.total_bytes,
           "gpu_count": machine.gpu_count, "device": device,
           "torch": machine.torch or torch_version(), "cuda": machine.cuda,
           "driver": machine.driver, "git": git_revision(),
           "python": platform.python_version(), "host": platform.node(), "part": part,
           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    path.write_text(json.dumps(doc, indent=2) + "\n")


def _pythonpath(hooks: bool = False) -> str:
    """src first (nothing is installed); the steps also get :data:`HOOKS`."""
    old = os.environ.get("PYTHONPATH")
    paths = [str(REPO / "src"), *([str(HOOKS)] if hooks else []), *([old] if old else [])]
    return os.pathsep.join(paths)


def display(argv: Sequence[str], env: dict[str, str]) -> str:
    """A command as a person would type it in the repository root."""
    import shlex

    shown = ["python3" if a == sys.executable else a for a in argv]
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return (prefix + " " if prefix else "") + "PYTHONPATH=src " + shlex.join(shown)


# --- running one step -------------------------------------------------------------------


def run_command(argv: Sequence[str], env: dict[str, str], log: Path, timeout_s: float,
                stdout: Path | None = None) -> tuple[int | None, float]:
    """Run ``argv`` in the repository root, output to ``log`` (stdout to ``stdout`` when
    given, stderr still to ``log``); (rc, seconds), rc None when it ran past ``timeout_s``
    (its whole process group is then stopped, :func:`stop_group`).

    The step gets a process group of its own but stays in the kit's session, so whatever
    ends the kit's session (the device tool, at the end of its call) ends the step too."""
    log.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, "PYTHONPATH": _pythonpath(hooks=True), "MPLBACKEND": "Agg",
                "PYTHONUNBUFFERED": "1", **env}
    started = time.perf_counter()
    with contextlib.ExitStack() as files:
        sink = files.enter_context(log.open("w"))
        out = files.enter_context(stdout.open("w")) if stdout is not None else sink
        proc = subprocess.Popen(argv, cwd=REPO, env=full_env, stdout=out,
                                stderr=sink if stdout is not None else subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, process_group=0)
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
            stop_group(proc, sink)
        finally:
            if proc.poll() is None:  # interrupted while waiting: leave nothing behind
                stop_group(proc, sink, dump=False)
    return rc, time.perf_counter() - started


def catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (Linux: /proc/PID/status)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def stop_group(proc: subprocess.Popen[Any], log: Any = None, dump: bool = True) -> None:
    """Stop a step's process group, keeping what it can still say: the leader's stacks
    (SIGUSR1, when hooks/sitecustomize.py installed its handler) into the log, SIGINT to
    the group (pytest ends its session and writes its junit XML, a bench suite raises
    KeyboardInterrupt where it is, ``torchgpu train`` stops at the step and saves), SIGTERM
    after :data:`INT_WAIT_S`, SIGKILL after :data:`TERM_WAIT_S` more."""
    usr1 = getattr(signal, "SIGUSR1", None)
    if dump and usr1 is not None and catches(proc.pid, usr1):
        if log is not None:
            log.write(f"\n== gpu-check: past its time limit; the stacks of pid {proc.pid}:\n")
            log.flush()
        try:
            os.kill(proc.pid, usr1)
            proc.wait(timeout=DUMP_WAIT_S)
            return  # it ended on its own just then
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    for sig, wait_s in ((signal.SIGINT, INT_WAIT_S), (signal.SIGTERM, TERM_WAIT_S),
                        (signal.SIGKILL, TERM_WAIT_S)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def tail(path: Path, chars: int = TAIL_CHARS) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-chars:]


def collect_train(scratch_dir: Path, dest: Path) -> list[str]:
    """Copy a train run's files (summary, metrics, config, plots, allocator snapshots) into
    the results: those over :data:`COPY_MAX_BYTES` gzipped (``NAME.gz``) when they are text
    or pickles and that brings them under it. Returns the files left behind, with their
    sizes (model weights, snapshots too big even gzipped)."""
    left = []
    if not scratch_dir.is_dir():
        return left
    dest.mkdir(parents=True, exist_ok=True)
    for path in sorted(p for p in scratch_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(scratch_dir)
        size = path.stat().st_size
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        if size <= COPY_MAX_BYTES:
            shutil.copy2(path, dest / rel)
            continue
        if path.suffix in COMPRESSIBLE:
            packed = dest / rel.with_name(rel.name + ".gz")
            with path.open("rb") as src, gzip.open(packed, "wb", compresslevel=6) as gz:
                shutil.copyfileobj(src, gz)
            if packed.stat().st_size <= COPY_MAX_BYTES:
                continue
            packed.unlink()
            left.append(f"{rel} ({size / 2**20:.1f} MiB, over {COPY_MAX_BYTES >> 20} MiB "
                        "even gzipped)")
            continue
        left.append(f"{rel} ({size / 2**20:.1f} MiB)")
    return left


# --- what a step's output must show, beyond its exit code ------------------------------


def _train_summary(step_dir: Path) -> dict[str, Any]:
    path = step_dir / "summary.json"
    if not path.exists():
        raise ValueError(f"no summary.json in {step_dir}: the run did not finish")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def check_train(step_dir: Path, log: Path, ctx: Ctx) -> str | None:
    summary = _train_summary(step_dir)
    if not summary.get("steps"):
        return "the run took no optimizer step"
    if summary.get("throughput_samples_per_s") is None:
        return "summary.json has no throughput"
    return None


def check_data_wait(step_dir: Path, log: Path, ctx: Ctx) -> str | None:
    """The run must report its data wait (the figure; its size is reported, not judged)."""
    summary = _train_summary(step_dir)
    share = summary.get("data_wait_share")
    if not isinstance(share, (int, float)):
        return "summary.json has no data_wait_share"
    return None


def check_auto_batch(step_dir: Path, log: Path, ctx: Ctx) -> str | None:
    """The search must have stopped at the memory limit, not at the data's size."""
    summary = _train_summary(step_dir)
    batch = summary.get("batch_size")
    total = summary.get("config", {}).get("data_size")
    if not isinstance(batch, int) or batch < 2:
        return f"batch size {batch!r} found: the search did not run"
    # The example keeps a third of --data-size for testing; the search stops at the rest.
    if isinstance(total, int) and batch >= total - total // 3:
        return (f"batch size {batch} equals the training set: the search hit the data, not "
                "the GPU's memory (raise --data-size)")
    return None


def check_oom_backoff(step_dir: Path, log: Path, ctx: Ctx) -> str | None:
    summary = _train_summary(step_dir)
    if not summary.get("oom_backoffs"):
        return "no OOM back-off recorded: the first step did not run out of memory"
    return check_train(step_dir, log, ctx)


def check_memory_snapshot(step_dir: Path, log: Path, ctx: Ctx) -> str | None:
    summary = _train_summary(step_dir)
    if not summary.get("memory_snapshots"):
        return "summary.json names no memory snapshot"
    return None


def check_estimate(step_dir: Path, log: Path, ctx: Ctx) -> str | None:
    data = json.loads((step_dir / "estimate.json").read_text())
    measured = [r for r in data["rows"] if r.get("measured_bytes")]
    if not measured:
        return "no model was measured"
    return None


def check_devices(step_dir: Path, log: Path, ctx: Ctx) -> str | None:
    data = json.loads(log.read_text())
    if ctx.device != "cuda":
        return None  # the JSON parsed: that is all a CPU machine can show
    if not data.get("nvml", {}).get("available"):
        return f"NVML not available: {data.get('nvml', {}).get('error')}"
    if not [d for d in data.get("devices", []) if d.get("kind") == "cuda"]:
        return "no CUDA device listed"
    return None


def check_hang(step_dir: Path, log: Path, ctx: Ctx) -> str | None:
    """The planted hang (rank 1 before step 3) must be named; on NCCL with its dumps."""
    text = log.read_text(errors="replace")
    if "the run hung" not in text or "rank(s) 1 did not reach" not in text:
        return "the launcher did not name rank 1 as the rank that did not arrive"
    if ctx.device == "cuda" and "flight_recorder" not in text:
        return "no NCCL flight-recorder dump was named"
    return None


CHECKS: dict[str, Callable[[Path, Path, Ctx], str | None]] = {
    "train": check_train, "auto_batch": check_auto_batch, "data_wait": check_data_wait,
    "oom_backoff": check_oom_backoff,
    "memory_snapshot": check_memory_snapshot, "estimate": check_estimate,
    "devices": check_devices, "hang": check_hang,
}


def step_dir(step: Step, results: Path) -> Path:
    """Where a step's collected files live (what its check reads)."""
    if step.outputs == "train":
        return results / "train" / step.name
    if step.check == "estimate":
        return results / "memory"
    return results


def run_step(step: Step, ctx: Ctx, results: Path, timeout_s: float) -> dict[str, Any]:
    """Run one step; its record (status pass|fail|timeout, rc, seconds, tail...)."""
    argv = step.command(ctx)
    env = step.environment(ctx)
    logs = results / "kit" / "logs"
    log = logs / f"{step.name}.log"
    stdout = logs / f"{step.name}.json" if step.json_stdout else None
    record = base_record(step, ctx)
    scratch = REPO / ctx.scratch  # commands run in the repository root: paths are from there
    if step.outputs == "train":
        out = scratch / step.name
        if out.exists():
            shutil.rmtree(out)  # our own scratch: a re-run replaces the earlier run
        shutil.rmtree(results / "train" / step.name, ignore_errors=True)
    print(f"== {step.name} (limit {timeout_s:.0f} s): {display(argv, env)}", flush=True)
    rc, seconds = run_command(argv, env, log, timeout_s, stdout=stdout)
    record.update(rc=rc, seconds=round(seconds, 1), timeout_s=round(timeout_s),
                  log=log.relative_to(results).as_posix())
    if stdout is not None:
        record["stdout"] = stdout.relative_to(results).as_posix()
    if step.outputs == "train":
        record["left_in_scratch"] = collect_train(scratch / step.name,
                                                  results / "train" / step.name)
    if rc is None:
        record.update(status="timeout", problem=f"ran past its {timeout_s:.0f} s limit "
                      "(stopped: its stacks and partial output are in its log)")
    elif rc not in step.ok_rcs:
        record.update(status="fail", problem=f"exit code {rc}")
    else:
        problem = None
        if step.check is not None:
            try:
                problem = CHECKS[step.check](step_dir(step, results), stdout or log, ctx)
            except (OSError, ValueError, KeyError, TypeError) as error:
                problem = f"output unreadable: {error}"
        record.update(status="fail" if problem else "pass", problem=problem)
    record["tail"] = tail(log)
    print(f"   {record['status']} in {seconds:.1f} s" + (f": {record['problem']}"
                                                       if record.get("problem") else ""),
          flush=True)
    return record


def base_record(step: Step, ctx: Ctx) -> dict[str, Any]:
    return {"name": step.name, "part": step.part, "budget_s": step.budget_s,
            "expect_s": step.expect_s, "priority": step.priority,
            "command": display(step.command(ctx), step.environment(ctx)),
            "needs": step.needs, "note": step.note}


def not_run(step: Step, ctx: Ctx, why: str, status: str = "not run") -> dict[str, Any]:
    record = base_record(step, ctx)
    record.update(status=status, problem=why, rc=None, seconds=0.0)
    return record


def save_records(results: Path, records: Sequence[dict[str, Any]]) -> None:
    """Merge ``records`` into ``kit/steps-<part>.json`` (a re-run replaces its entries)."""
    kit = results / "kit"
    kit.mkdir(parents=True, exist_ok=True)
    for part in dict.fromkeys(r["part"] for r in records):
        path = kit / f"steps-{part}.json"
        old = json.loads(path.read_text()) if path.exists() else []
        mine = [r for r in records if r["part"] == part]
        names = {r["name"] for r in mine}
        merged = [r for r in old if r["name"] not in names] + mine
        path.write_text(json.dumps(merged, indent=2) + "\n")


def why_skipped(step: Step, ctx: Ctx, machine: Machine) -> tuple[str, str] | None:
    """(status, reason) for a step this machine cannot run, else None."""
    if step.needs == "2gpus" and machine.gpu_count < 2:
        return "needs 2 GPUs", (f"needs 2 GPUs ({machine.gpu_count} here): run this command "
                                "on such a machine (make gpu-check PART=multi)")
    if step.needs == "cuda" and ctx.device != "cuda":
        return "not run", "needs CUDA (the kit runs with --device cpu)"
    return None


def step_limit(plan: Plan, step: Step, later_budget_s: float, left_s: float) -> float | None:
    """How long ``step`` may run with ``left_s`` seconds to the deadline, or None when
    it must not start (its expected time no longer fits).

    One part alone (``plan.fill``): the time left is shared out in proportion to the
    budgets of this step and the ``later_budget_s`` of the runnable steps after it, so
    every budget is scaled up to fill the part's call, and time a step did not use goes
    to the ones after it. PART=all: each step keeps its own budget (they add up to far
    more than the deadline), highest priority first. Either way a step's limit leaves
    :data:`steps.STOP_GRACE_S` to stop it before the deadline."""
    usable = left_s - STOP_GRACE_S
    if usable < max(step.expect_s, MIN_START_S):
        return None
    if plan.fill:
        return usable * step.budget_s / (step.budget_s + later_budget_s)
    return min(float(step.budget_s), usable)


def run_plan(plan: Plan, ctx: Ctx, results: Path, machine: Machine,
             clock: Callable[[], float] = time.monotonic, started: float | None = None,
             after_step: Callable[[list[dict[str, Any]]], None] | None = None,
             ) -> list[dict[str, Any]]:
    """Every step of ``plan`` in order, within the plan's deadline counted from
    ``started`` (the kit's start; default now). ``after_step`` runs after each step with
    the records so far (the summary and the archive are refreshed there)."""
    deadline = (clock() if started is None else started) + plan.deadline_s - RESERVE_S
    skipped = {s.name: why_skipped(s, ctx, machine) for s in plan.steps}
    records: list[dict[str, Any]] = []
    for index, step in enumerate(plan.steps):
        left = deadline - clock()
        later = sum(s.budget_s for s in plan.steps[index + 1:] if skipped[s.name] is None)
        limit = step_limit(plan, step, later, left) if skipped[step.name] is None else None
        reason = skipped[step.name]
        if reason is not None:
            record = not_run(step, ctx, reason[1], status=reason[0])
        elif limit is None:
            record = not_run(step, ctx, f"out of time: {max(left, 0):.0f} s left of the "
                             f"kit's {plan.deadline_s} s, it needs ~{step.expect_s} s"
                             + ("" if plan.fill else f"; run PART={step.part} for it"))
        else:
            try:
                record = run_step(step, ctx, results, limit)
            except KeyboardInterrupt:
                records.append(not_run(step, ctx, "the kit was stopped (SIGINT/SIGTERM) "
                                       "while this step ran; see its log",
                                       status="interrupted"))
                save_records(results, records)
                raise
        records.append(record)
        save_records(results, records)  # a killed kit still leaves what it did
        if after_step is not None:
            after_step(records)
    return records


# --- the command line -------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks/gpu/kit.py", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", default="default",
                   choices=(*plan_mod.PARTS, *plan_mod.SELECTIONS),
                   help="which part to run (default: the most important steps within 8 "
                        "minutes; rest: every other one-GPU step; all: every one-GPU step "
                        "by priority; multi needs 2 GPUs)")
    p.add_argument("--only", default="", metavar="STEP,...", help="only these steps")
    p.add_argument("--dry-run", action="store_true", help="print every command, run nothing")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu runs the CPU-capable steps on the CPU (to exercise the kit)")
    p.add_argument("--tag", help="results directory name (default: from the GPU's name)")
    p.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results",
                   help="where <tag>/ is written (default benchmarks/results)")
    p.add_argument("--scratch", type=Path, default=REPO / "runs" / "gpu-kit",
                   help="where bulky run outputs go (default runs/gpu-kit; not packed)")
    p.add_argument("--out", type=Path, default=None,
                   help="pack the results into a .tar.gz here (default: $OUT when set)")
    p.add_argument("--threads", type=int, default=min(os.cpu_count() or 1, 16),
                   help="CPU threads for the CPU rows of matmul (default: the cores, <= 16)")
    p.add_argument("--summary-only", action="store_true",
                   help="rebuild summary.json/.md from the results directory, run nothing")
    return p


def _rel(path: Path) -> str:
    try:
        return path.resolve().relative_to(REPO).as_posix()
    except ValueError:
        return str(path)


def plan_label(plan: Plan) -> tuple[str, ...]:
    """What names the archive: the selection (default, rest) or the parts."""
    return (plan.name,) if plan.name in ("default", "rest") else plan.parts


def dry_run(plan: Plan, ctx: Ctx, out: Path | None) -> str:
    """The text ``--dry-run`` prints: every command in the order it runs, with its budget
    (one part alone: and the limit it gets when every step before it uses all of its
    share) or, for PART=all, its expected time and whether that fits the deadline."""
    budgets = sum(s.budget_s for s in plan.steps)
    usable = plan.deadline_s - RESERVE_S - STOP_GRACE_S
    how = (f"budgets scaled by {usable / budgets:.2f} to fill it" if plan.fill and budgets
           else "by priority; a step starts only when its expected time still fits")
    label = plan.name or "+".join(plan.parts)
    lines = [f"# GPU check, PART={label}: results in {ctx.results}/, deadline "
             f"{plan.deadline_s} s from the kit's start, step budgets add up to {budgets} s "
             f"({how})"]
    expected = 0
    for step in plan.steps:
        need = {"cuda": "  [needs CUDA]", "2gpus": "  [needs 2 GPUs]"}.get(step.needs or "", "")
        if plan.fill:
            timing = (f"budget {step.budget_s} s, limit ~{usable * step.budget_s / budgets:.0f}"
                      f" s, expect ~{step.expect_s} s")
        else:
            expected += step.expect_s if step.needs != "2gpus" else 0
            fits = "fits" if expected <= usable else "only if earlier steps end early"
            timing = (f"priority {step.priority}, expect ~{step.expect_s} s (by then "
                      f"~{expected} s: {fits}), limit {step.budget_s} s")
        lines.append(f"[{step.part}] {step.name} ({timing}){need}")
        lines.append("  " + display(step.command(ctx), step.environment(ctx)))
    if "multi" not in plan.parts:
        lines.append("# needs 2 GPUs (not run on one GPU; run on a 2-GPU machine with "
                     "PART=multi, or each command):")
        lines += [f"  {s.name}: {display(s.command(ctx), s.environment(ctx))}"
                  for s in plan_mod.multi_gpu_steps()]
    lines.append(f"# after each step: summary.json and summary.md in {ctx.results}/"
                 + (f"; archive {out}/"
                    f"{pack.archive_name(Path(ctx.results).name, plan_label(plan))}"
                    if out else "; set OUT=DIR to pack the results into DIR/<name>.tar.gz"))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    started = time.monotonic()  # the deadline counts from here, GPU detection included
    args = _parser().parse_args(argv)
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _interrupt)  # the finally blocks stop the running step
    try:
        return _main(args, started)
    except KitError as error:
        print(f"gpu-check: {error}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _main(args: argparse.Namespace, started: float) -> int:
    only = [n.strip() for n in args.only.split(",") if n.strip()]
    try:
        plan = plan_mod.make_plan(args.part, only)
    except ValueError as error:
        raise KitError(str(error)) from error
    out = args.out if args.out is not None else (Path(os.environ["OUT"]) if os.environ.get(
        "OUT") else None)
    py = sys.executable
    machine = Machine(None, None, 0)  # no GPU detected (dry run, --device cpu)
    if args.tag:
        tag = args.tag
    elif args.dry_run:
        tag = "<gpu-tag>"
    elif args.device == "cuda":
        machine = detect(py)
        if machine.name is None:
            raise KitError("no CUDA GPU is visible here (`torchgpu devices` lists none): run "
                           "the kit on a GPU machine, print its commands with DRY_RUN=1, or "
                           "pass --device cpu to exercise it on the CPU")
        tag = gpu_tag(machine.name, machine.total_bytes)
    else:
        tag = "cpu-" + (os.uname().nodename.split(".")[0] or "host")
    if args.device == "cuda" and args.tag and not args.dry_run and not args.summary_only:
        machine = detect(py)
    results = args.results / tag
    ctx = Ctx(device=args.device, results=_rel(results), scratch=_rel(args.scratch / tag),
              py="python3" if args.dry_run else py, threads=args.threads, repo=REPO)
    if args.dry_run:
        print(dry_run(plan, ctx, out))
        return 0
    multi = [(s.name, display(s.command(ctx), s.environment(ctx)), s.note)
             for s in plan_mod.multi_gpu_steps()]
    archive_name = pack.archive_name(tag, plan_label(plan))

    def refresh(quiet: bool = True) -> dict[str, Any]:
        """summary.json/.md from the results directory, and the archive under OUT."""
        doc = summary_mod.write(results, multi=multi, device_name=machine.name)
        if out is not None:
            archive, skipped = pack.pack(results, out, archive_name)
            if not quiet:
                print(f"packed: {archive} ({archive.stat().st_size / 2**20:.2f} MiB)"
                      + (f"; left out for size: {', '.join(skipped)}" if skipped else ""))
        return doc

    failed = interrupted = False
    if not args.summary_only:
        results.mkdir(parents=True, exist_ok=True)
        write_machine(results, machine, args.device, plan.name or "+".join(plan.parts))
        try:
            records = run_plan(plan, ctx, results, machine, started=started,
                               after_step=lambda _records: refresh())
            failed = any(r["status"] in FAILED for r in records)
        except KeyboardInterrupt:
            interrupted = True
            print("gpu-check: interrupted; summarising what ran", file=sys.stderr, flush=True)
    doc = refresh(quiet=False)
    counts = ", ".join(f"{n} {status}" for status, n in doc["counts"].items())
    print(f"summary: {_rel(results / 'summary.md')} ({counts}); "
          f"{time.monotonic() - started:.0f} s in all")
    if interrupted:
        return 130
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
