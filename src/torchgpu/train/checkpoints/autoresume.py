"""``--autoresume`` (``fit(autoresume=True)``): one command line for every run of a job.

A requeued cluster job runs the same command again, and the run in ``--out`` decides what
it does, before ``--out`` is written: a **finished** run (:func:`check_finished`) raises
:class:`RunFinished` (the CLI prints its report and exits 0, ``fit`` returns its result);
a **checkpoint** is continued from the newest complete one, exactly as ``--resume`` does;
a run's files but **no checkpoint** (it crashed before its first save) are removed, as
``--overwrite`` would, and the run starts over with a note; nothing there: it starts.
``continue_hint`` tells a stopped or failed run's user how to continue, in the words
of the way it was started (the CLI's flags or ``fit``'s arguments).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torchgpu.errors import UsageError
from torchgpu.train.config import TrainConfig
from torchgpu.train.outputs import files as outputs


def from_fit(config: TrainConfig) -> bool:
    """Whether ``config`` came from :func:`torchgpu.fit` (its model is an object)."""
    return (config.model or "").startswith("fit:")


def continue_hint(config: TrainConfig) -> str:
    """How to continue the stopped run of ``config``: words for a sentence after "To
    continue, " -- fit's arguments for a fit run, else the command line's flags."""
    if from_fit(config):
        if config.autoresume:
            return "call fit(...) again as it is (autoresume=True continues the run)"
        return "call fit(...) again with resume=True (or autoresume=True)"
    if config.autoresume:
        return "run the same command again (--autoresume continues the run)"
    return f"run the same command with --resume --out {config.out}"


class RunFinished(Exception):
    """``--autoresume`` found the run in ``--out`` finished: nothing to do (not an error;
    the CLI exits 0). ``summary``: the finished run's summary.json."""

    def __init__(self, config: TrainConfig, summary: dict[str, Any]) -> None:
        self.config, self.summary = config, summary
        out = config.out
        again = ("call fit(...) with overwrite=True instead of autoresume=True"
                 if from_fit(config) else "pass --overwrite instead of --autoresume")
        super().__init__(
            f"--autoresume: the run in {out} already finished ({summary.get('epochs')} "
            f"epochs, {summary.get('steps')} steps; {out}/{outputs.SUMMARY_FILE}): nothing to "
            f"do, nothing was changed. Its model is {out}/{outputs.MODEL_FILE}. To train it "
            f"again from scratch, {again}, or use another --out.")


def read_summary(out: Path) -> dict[str, Any] | None:
    """``out``'s summary.json as a dict, or None when it is missing or unreadable (a run
    that crashed never wrote one: it is written last, atomically)."""
    try:
        summary = json.loads((out / outputs.SUMMARY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def finished(summary: dict[str, Any] | None) -> bool:
    """Whether ``summary`` is that of a run that ran to its end (not stopped early)."""
    return summary is not None and summary.get("stopped_early") is False


def check_finished(config: TrainConfig, has_checkpoint: bool) -> None:
    """Raise :class:`RunFinished` when ``config.out`` holds this run finished (as many
    epochs as ``config.epochs``); UsageError when it holds a finished run of another
    length and no checkpoint, which starting over would delete."""
    assert config.out is not None
    summary = read_summary(Path(config.out))
    if not finished(summary):
        return
    assert summary is not None
    if summary.get("epochs") == config.epochs:
        raise RunFinished(config, summary)
    if not has_checkpoint:
        raise UsageError(
            f"--autoresume: {config.out} holds a finished run of {summary.get('epochs')} "
            f"epochs with no checkpoint, and this run asks for {config.epochs} epochs: there "
            "is nothing to continue from, and starting over would delete the finished run. "
            f"Pass --epochs {summary.get('epochs')} (it is finished: nothing to do), another "
            "--out, or --overwrite instead of --autoresume to train it again.")
