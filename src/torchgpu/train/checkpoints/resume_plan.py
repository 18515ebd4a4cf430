"""Where a run starts: from scratch, from a checkpoint ``--resume`` names, or -- under a
torchrun restart -- from the run's own newest checkpoint (``plan_resume``).

Decided during assembly, before ``--out`` is written: a resume that finds no checkpoint,
or one saved with settings the run now changes (the data position and optimizer state
would mean something else), or -- unless ``--force-resume`` -- one saved by a run whose
files (a spec's file, a CSV: :mod:`torchgpu.train.fingerprints`) changed since, is
refused here (:class:`~torchgpu.errors.ResumeError`).
Loading the checkpoint is ``torchgpu.train.checkpoints.run_checkpoints.RunCheckpoints``' job.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchgpu.checkpoint import find_checkpoint
from torchgpu.checkpoint.layout import read_meta
from torchgpu.errors import ResumeError
from torchgpu.train.checkpoints.autoresume import check_finished
from torchgpu.train.checkpoints.world_change import LAYOUT, WorldChange
from torchgpu.train.checkpoints.world_change import plan as plan_world_change
from torchgpu.train.config import TrainConfig
from torchgpu.train.fingerprints import changed_files
from torchgpu.train.outputs.files import CHECKPOINTS_DIR as CHECKPOINTS_DIR
from torchgpu.train.outputs.files import run_entries
from torchgpu.train.schedule import FIXED as SCHEDULE_FIXED

RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
# Settings that give the saved position its meaning; a resume must not change them (but
# for a world change, which keeps the effective batch: torchgpu.train.checkpoints.world_change).
FIXED = ("run_name", "example", "data", "target", "data_size", "seed", "batch_size",
          "accumulate", "lr", "world_size", "batches_per_epoch")


def checkpoints_dir(out: str | Path) -> Path:
    """Where a run with ``--out OUT`` keeps its checkpoints: ``OUT/checkpoints``."""
    return Path(out) / CHECKPOINTS_DIR


def restart_count(environ: Mapping[str, str] | None = None) -> int:
    """How many times torchrun has restarted this worker group (0 outside torchrun)."""
    raw = (os.environ if environ is None else environ).get(RESTART_ENV, "0")
    try:
        return max(0, int(raw))
    except ValueError:
        return 0


@dataclass(frozen=True)
class ResumePlan:
    """Where a run starts. ``source``: the checkpoint directory to resume from (``None``:
    from scratch). ``continuing``: ``--out`` may already hold this run's files.
    ``notes``: what to tell the user (a fallback, a restart). ``named``: ``source`` was
    given explicitly (``--resume CHECKPOINT_DIR``), not found through ``latest``, so a
    damaged one is an error rather than a fallback. ``start_over``: ``--out`` holds a
    run that cannot be continued (``--autoresume``, no checkpoint): its entries are
    removed before the run writes, as ``--overwrite`` does. ``change``: ``source`` was
    saved by another number of processes (apply it to the config)."""

    source: Path | None = None
    continuing: bool = False
    notes: tuple[str, ...] = ()
    named: bool = False
    start_over: bool = False
    # ``source`` was saved by another number of data-parallel processes: the accumulation
    # that keeps its effective batch (:mod:`torchgpu.train.checkpoints.world_change`)
    change: WorldChange | None = None


def _find(where: Path) -> tuple[Path | None, tuple[str, ...]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = find_checkpoint(where)
    return found, tuple(f"note: {w.message}" for w in caught)


def plan_resume(config: TrainConfig, environ: Mapping[str, str] | None = None, *,
                check_files: bool = True, world: int | None = None,
                strategy: str | None = None) -> ResumePlan:
    """Decide where the run (``config`` resolved: ``out`` set) starts; touches nothing but
    orphan temporaries. Raises :class:`ResumeError` when ``--resume`` finds no checkpoint
    or its run's files changed (``check_files``: hash them; False where another process
    of the run has checked them). ``world`` and ``strategy``: the run's data-parallel
    processes and strategy; a checkpoint of another world size is continued when the
    strategy reads its layout and the effective batch can be kept (the plan's ``change``:
    :func:`torchgpu.train.checkpoints.world_change.plan`).

    ``--resume``: ``OUT/checkpoints``; ``--resume DIR``: DIR. Under a torchrun restart the
    run's own newest checkpoint wins (it is newer than DIR); without one, ``--resume`` is
    honoured as given, or the run starts over.
    """
    assert config.out is not None
    restarts = restart_count(environ)
    own = checkpoints_dir(config.out)
    if restarts > 0:
        found, notes = _find(own)
        if found is not None:
            return ResumePlan(found, True, (
                *notes, f"note: torchrun restart {restarts}: resuming from {found}"),
                change=plan_world_change(found, config, world, strategy))
        if config.resume is None:
            return ResumePlan(None, True, (
                f"note: torchrun restart {restarts}: no checkpoint in {own} yet; "
                "starting the run over",))
    if config.autoresume:
        return _autoresume(config, own, world, strategy)
    if config.resume is None:
        return ResumePlan()
    where = Path(config.resume) if config.resume else own
    found, notes = _find(where)
    if found is None:
        raise ResumeError(
            f"--resume found no complete checkpoint in {where}: nothing to continue from, and "
            "a resume never starts a fresh run silently. Pass the run's --out (its "
            "checkpoints are written there by --save-every N or when a run is stopped), "
            "--resume DIR naming a run, its checkpoints/ directory or one checkpoint, or "
            "drop --resume to start from scratch."
        )
    change = _check_saved_settings(config, found, world, strategy)
    if check_files:
        notes += _check_files(config, found)
    return ResumePlan(found, True, notes, named=found.resolve() == where.resolve(),
                      change=change)


def _autoresume(config: TrainConfig, own: Path, world: int | None,
                strategy: str | None) -> ResumePlan:
    """``--autoresume`` (:mod:`torchgpu.train.checkpoints.autoresume`): a finished run raises
    RunFinished; the newest complete checkpoint is continued; a run without one starts
    over (its entries removed); no run starts."""
    found, notes = _find(own)
    check_finished(config, found is not None)
    if found is not None:
        change = _check_saved_settings(config, found, world, strategy)
        return ResumePlan(found, True, (
            *notes, f"note: --autoresume: continuing the run in {config.out} from {found}"),
            change=change)
    entries = run_entries(Path(str(config.out)))
    if entries:
        return ResumePlan(None, False, (
            f"note: --autoresume: {config.out} holds a run with no checkpoint to continue "
            f"from ({', '.join(entries)}): removed, starting the run over",), start_over=True)
    return ResumePlan(None, False, (
        f"note: --autoresume: no checkpoint in {own} yet: starting the run",))


def saved_changes(config: TrainConfig, found: Path, *,
                  keep: tuple[str, ...] = ()) -> list[tuple[str, Any, Any]]:
    """``(setting, saved value, value in config)`` for each setting the saved position of
    checkpoint ``found`` depends on that ``config`` changes, as far as the checkpoint's
    meta.json and ``config`` tell it now (the rest -- world size, batches per epoch, a
    searched batch size -- is checked when the checkpoint is loaded); the settings in
    ``keep`` are not compared."""
    saved = read_meta(found).get("config")
    if not isinstance(saved, dict):
        return []
    return [(key, saved[key], getattr(config, key)) for key in (*FIXED, *SCHEDULE_FIXED)
            if key in saved and key not in keep and getattr(config, key, None) is not None
            and saved[key] != getattr(config, key)]


def _check_saved_settings(config: TrainConfig, found: Path, world: int | None = None,
                          strategy: str | None = None) -> WorldChange | None:
    """Refuse, before anything is written, a resume that changes a setting the saved
    position depends on (:func:`saved_changes`); on another world size (``world``,
    ``strategy``: :func:`torchgpu.train.checkpoints.world_change.plan`) the per-process batch and
    accumulation may change where the effective batch stays: the change, returned."""
    change = plan_world_change(found, config, world, strategy)
    keep = LAYOUT if change is not None else ()
    changed = [f"{key} {was!r} -> {now!r}"
               for key, was, now in saved_changes(config, found, keep=keep)]
    if changed:
        raise cannot_resume(found, changed)
    return change


def _check_files(config: TrainConfig, found: Path) -> tuple[str, ...]:
    """Refuse a resume from ``found`` when a file the run is built from changed since the
    checkpoint's run recorded it (its meta.json's ``fingerprints``), unless
    ``--force-resume``: then the notes that say which."""
    changes = changed_files(read_meta(found).get("fingerprints"), config)
    if not changes:
        return ()
    which = "; ".join(change.words() for change in changes)
    if config.force_resume:
        return (f"note: --force-resume: resuming from {found} although {which} changed "
                "since it was saved",)
    raise ResumeError(
        f"cannot resume from {found}: {which} changed since the checkpoint was saved, so "
        "the run would continue with another model, data or loss than it trained with. "
        "Restore the file, start a new run (another --out, without --resume), or pass "
        "--force-resume (force_resume=True in fit) to go on with the file as it is now."
    )


def cannot_resume(path: Path, changed: list[str]) -> ResumeError:
    return ResumeError(
        f"cannot resume from {path} exactly: {', '.join(changed)} differ from the run that "
        "saved it, so its data position and optimizer state mean something else. Resume "
        "with the saved values, or start a new run (another --out, without --resume)."
    )
