"""The GPU check: run the tests, benchmarks and training runs a GPU machine can settle, one
part per device call, and leave every figure in ``benchmarks/results/<gpu-tag>/``.

    PYTHONPATH=src python3 benchmarks/gpu/kit.py --part tests|bench|train|multi|all
    PYTHONPATH=src python3 benchmarks/gpu/kit.py --dry-run         # print every command
    PYTHONPATH=src python3 benchmarks/gpu/kit.py --summary-only --tag h100-sxm-80gb

Nothing is installed: commands run as ``python3 -m torchgpu ...`` with ``PYTHONPATH=src``.
Each step (:mod:`steps`) runs in its own process group with its time budget; its exit
code, time and output tail go to ``<results>/kit/steps-<part>.json`` and its whole output
to ``<results>/kit/logs/<step>.log``. A failed step is recorded and the kit goes on. The
kit stops starting steps when its deadline nears (9 minutes for ``all``), recording the
rest as not run. At the end it writes ``summary.json`` and ``summary.md`` (:mod:`summary`)
from everything in the results directory, so parts run in separate calls add up, and,
when ``OUT`` is set (or ``--out``), packs the directory into one ``.tar.gz`` there.

Exit code: 0 when every step that ran passed, 1 when one failed, 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import os
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
from steps import RESERVE_S, Ctx, Plan, Step  # noqa: E402
from tag import gpu_tag  # noqa: E402

TAIL_CHARS = 3000  # of a step's output kept in its record
COPY_MAX_BYTES = 4 * 2**20  # train outputs larger than this stay in the scratch directory
KILL_GRACE_S = 10


class KitError(Exception):
    """Bad input or a machine the kit cannot run on: one paragraph, exit 2."""


@dataclass(frozen=True)
class Machine:
    """What the kit runs on: the GPU's name, memory and count (name None: no GPU)."""

    name: str | None
    total_bytes: int | None
    gpu_count: int


def detect(py: str, timeout_s: float = 90) -> Machine:
    """The GPUs as ``torchgpu devices --json`` sees them (NVML first: CUDA stays
    uninitialised in this process, so the steps get the whole GPU)."""
    env = {**os.environ, "PYTHONPATH": _pythonpath()}
    try:
        done = subprocess.run([py, "-m", "torchgpu", "devices", "--json"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=timeout_s, check=False)
        data = json.loads(done.stdout)
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError) as error:
        raise KitError(f"could not list the GPUs with `torchgpu devices --json` ({error}); "
                       "run it by hand to see why, or pass --tag NAME to skip detection "
                       "with --dry-run") from error
    gpus = [d for d in data.get("devices", []) if d.get("kind") == "cuda"]
    if not gpus:
        return Machine(None, None, 0)
    return Machine(gpus[0].get("name"), gpus[0].get("total_bytes"), len(gpus))


def _pythonpath() -> str:
    old = os.environ.get("PYTHONPATH")
    return str(REPO / "src") + (os.pathsep + old if old else "")


def display(argv: Sequence[str], env: dict[str, str]) -> str:
    """A command as a person would type it in the repository root."""
    import shlex

    shown = ["python3" if a == sys.executable else a for a in argv]
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return (prefix + " " if prefix else "") + "PYTHONPATH=src " + shlex.join(shown)


# --- running one step -------------------------------------------------------------------


def run_command(argv: Sequence[str], env: dict[str, str], log: Path, timeout_s: float
                ) -> tuple[int | None, float]:
    """Run ``argv`` in the repository root, output to ``log``; (rc, seconds), rc None when
    it ran past ``timeout_s`` (its whole process group is then stopped)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, "PYTHONPATH": _pythonpath(), "MPLBACKEND": "Agg", **env}
    started = time.perf_counter()
    with log.open("w") as sink:
        proc = subprocess.Popen(argv, cwd=REPO, env=full_env, stdout=sink,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
            _stop_group(proc)
        finally:
            if proc.poll() is None:  # interrupted while waiting: leave nothing behind
                _stop_group(proc)
    return rc, time.perf_counter() - started


def _stop_group(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM the step's process group, SIGKILL what is left after a grace period."""
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, KILL_GRACE_S)):
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
    """Copy a train run's small files (summary, metrics, config, plots, HTML) into the
    results; returns the names left behind for their size (model weights, pickles)."""
    left = []
    if not scratch_dir.is_dir():
        return left
    dest.mkdir(parents=True, exist_ok=True)
    for path in sorted(p for p in scratch_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(scratch_dir)
        if path.stat().st_size > COPY_MAX_BYTES:
            left.append(f"{rel} ({path.stat().st_size / 2**20:.1f} MiB)")
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest / rel)
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
    "train": check_train, "auto_batch": check_auto_batch, "oom_backoff": check_oom_backoff,
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
    log = results / "kit" / "logs" / f"{step.name}.log"
    record = base_record(step, ctx)
    scratch = REPO / ctx.scratch  # commands run in the repository root: paths are from there
    if step.outputs == "train":
        out = scratch / step.name
        if out.exists():
            shutil.rmtree(out)  # our own scratch: a re-run replaces the earlier run
        shutil.rmtree(results / "train" / step.name, ignore_errors=True)
    print(f"== {step.name} (budget {timeout_s:.0f} s): {display(argv, env)}", flush=True)
    rc, seconds = run_command(argv, env, log, timeout_s)
    record.update(rc=rc, seconds=round(seconds, 1), timeout_s=round(timeout_s),
                  log=log.relative_to(results).as_posix())
    if step.outputs == "train":
        record["left_in_scratch"] = collect_train(scratch / step.name,
                                                  results / "train" / step.name)
    if rc is None:
        record.update(status="timeout", problem=f"ran past its {timeout_s:.0f} s budget")
    elif rc not in step.ok_rcs:
        record.update(status="fail", problem=f"exit code {rc}")
    else:
        problem = None
        if step.check is not None:
            try:
                problem = CHECKS[step.check](step_dir(step, results), log, ctx)
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
            "command": display(step.command(ctx), step.environment(ctx)),
            "needs": step.needs, "note": step.note}


def not_run(step: Step, ctx: Ctx, why: str) -> dict[str, Any]:
    record = base_record(step, ctx)
    record.update(status="not run", problem=why, rc=None, seconds=0.0)
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


def run_plan(plan: Plan, ctx: Ctx, results: Path, machine: Machine,
             clock: Callable[[], float] = time.monotonic) -> list[dict[str, Any]]:
    """Every step of ``plan`` in order, within the plan's deadline."""
    deadline = clock() + plan.deadline_s - RESERVE_S
    records: list[dict[str, Any]] = []
    for step in plan.steps:
        left = deadline - clock()
        if step.needs == "2gpus" and machine.gpu_count < 2:
            record = not_run(step, ctx, f"needs 2 GPUs ({machine.gpu_count} here): run "
                             "this command on such a machine")
        elif step.needs == "cuda" and ctx.device != "cuda":
            record = not_run(step, ctx, "needs CUDA (the kit runs with --device cpu)")
        elif left < min(step.budget_s, 5):
            record = not_run(step, ctx, f"out of time: {max(left, 0):.0f} s left of the "
                             f"kit's {plan.deadline_s} s")
        else:
            record = run_step(step, ctx, results, min(step.budget_s, left))
        records.append(record)
        save_records(results, records)  # a killed kit still leaves what it did
    return records


# --- the command line -------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks/gpu/kit.py", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", default="all", choices=(*plan_mod.PARTS, "all"),
                   help="which part to run (all = tests, bench and train; multi needs 2 GPUs)")
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


def dry_run(plan: Plan, ctx: Ctx, out: Path | None) -> str:
    """The text ``--dry-run`` prints: every command, grouped by part, with its budget."""
    lines = [f"# GPU check, PART={'+'.join(plan.parts)}: results in {ctx.results}/, deadline "
             f"{plan.deadline_s} s, step budgets add up to "
             f"{sum(s.budget_s for s in plan.steps)} s"]
    for step in plan.steps:
        need = {"cuda": "  [needs CUDA]", "2gpus": "  [needs 2 GPUs]"}.get(step.needs or "", "")
        lines.append(f"[{step.part}] {step.name} ({step.budget_s} s){need}")
        lines.append("  " + display(step.command(ctx), step.environment(ctx)))
    if "multi" not in plan.parts:
        lines.append("# needs 2 GPUs (not run on one GPU; run on a 2-GPU machine with "
                     "PART=multi, or each command):")
        lines += [f"  {s.name}: {display(s.command(ctx), s.environment(ctx))}"
                  for s in plan_mod.multi_gpu_steps()]
    lines.append(f"# then: summary.json and summary.md in {ctx.results}/"
                 + (f"; archive {out}/{pack.archive_name(Path(ctx.results).name, plan.parts)}"
                    if out else "; set OUT=DIR to pack the results into DIR/<name>.tar.gz"))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _main(args)
    except KitError as error:
        print(f"gpu-check: {error}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    only = [n.strip() for n in args.only.split(",") if n.strip()]
    try:
        plan = plan_mod.make_plan(args.part, only)
    except ValueError as error:
        raise KitError(str(error)) from error
    out = args.out if args.out is not None else (Path(os.environ["OUT"]) if os.environ.get(
        "OUT") else None)
    py = sys.executable
    machine = Machine(None, None, 1)
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
    failed = False
    if not args.summary_only:
        results.mkdir(parents=True, exist_ok=True)
        records = run_plan(plan, ctx, results, machine)
        failed = any(r["status"] in ("fail", "timeout") for r in records)
    multi = [(s.name, display(s.command(ctx), s.environment(ctx)), s.note)
             for s in plan_mod.multi_gpu_steps()]
    doc = summary_mod.write(results, multi=multi, device_name=machine.name)
    counts = ", ".join(f"{n} {status}" for status, n in doc["counts"].items())
    print(f"summary: {_rel(results / 'summary.md')} ({counts})")
    if out is not None:
        archive, skipped = pack.pack(results, out, pack.archive_name(tag, plan.parts))
        print(f"packed: {archive} ({archive.stat().st_size / 2**20:.2f} MiB)"
              + (f"; left out for size: {', '.join(skipped)}" if skipped else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
