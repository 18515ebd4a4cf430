"""A ``torchgpu train`` checkpoint's position, read back and checked before a resume
uses it (:class:`torchgpu.train.checkpoints.run_checkpoints.RunCheckpoints` loads it).

A checkpoint's files can match their manifest and still hold what no save writes (a
``state.pt`` edited and its manifest rewritten, or written by a buggy tool): each field
the run relies on is checked here, and a bad one is a one-paragraph
:class:`~torchgpu.errors.CheckpointFormatError` naming the checkpoint, the field and what
was expected. A resume that asks for fewer optimizer steps than the checkpoint has done
is a ``ResumeStepsError``. Both are raised before a file under
``--out`` changes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from torchgpu.errors import CheckpointFormatError, ResumeStepsError
from torchgpu.train.config import TrainConfig
from torchgpu.train.outputs.files import EpochRecord
from torchgpu.train.state import TrainState


def epoch_record(data: Mapping[str, Any]) -> EpochRecord:
    """The EpochRecord that ``record.as_dict()`` saved: its ``test_<name>`` entries are the
    task's metrics again (``None`` ones left out: checkpoints written before metrics were
    plug-ins hold ``test_r2: None`` / ``test_accuracy: None`` for tasks without them)."""
    names = {f.name for f in dataclasses.fields(EpochRecord)}
    values = {k: v for k, v in data.items() if k in names}
    for key in ("train_loss", "test_loss", "samples_per_s", "seconds"):
        values[key] = math.nan if values.get(key) is None else float(values[key])
    values["metrics"] = {k[len("test_"):]: float(v) for k, v in data.items()
                         if k.startswith("test_") and k != "test_loss" and v is not None}
    return EpochRecord(**values)


def saved_position(path: Path, extra: Mapping[str, Any], batches_per_epoch: int,
                   accumulate: int, optimizer: Any) -> tuple[TrainState, list[EpochRecord]]:
    """The position (``extra["train_state"]``) and finished epochs' records
    (``extra["epochs"]``) of the checkpoint at ``path``, checked against the run's epoch
    length and against the ``optimizer`` its state was loaded into; CheckpointFormatError
    naming the first field that is not what a save writes."""
    try:
        state = TrainState.from_saved(extra["train_state"])
        per_epoch = math.ceil(batches_per_epoch / accumulate)
        if state.batch_in_epoch > batches_per_epoch:
            raise ValueError(f"train_state.batch_in_epoch is {state.batch_in_epoch}; "
                             f"expected at most {batches_per_epoch}, the batches of one "
                             "epoch")
        if state.step > per_epoch * (state.epoch + 1):
            raise ValueError(
                f"train_state.step is {state.step}; expected at most "
                f"{per_epoch * (state.epoch + 1)} at epoch {state.epoch + 1} "
                f"({per_epoch} optimizer steps per epoch)")
        _check_optimizer_steps(optimizer, state.step)
        epochs = extra.get("epochs", [])
        if not isinstance(epochs, list) or not all(isinstance(r, dict) for r in epochs):
            raise ValueError(f"epochs is a {type(epochs).__name__}; expected a list of the "
                             "finished epochs' records")
        try:
            records = [epoch_record(r) for r in epochs]
        except (TypeError, ValueError) as error:
            raise ValueError(f"epochs holds a record that is not an epoch's ({error}); "
                             "expected the finished epochs' records") from None
    except ValueError as error:
        raise CheckpointFormatError(
            f"cannot resume from {path}: its state.pt {error}. Its files match their "
            "manifest, so it was changed or written wrongly after the run saved it: resume "
            "from another checkpoint of the run (--resume DIR), or start without --resume."
        ) from None
    return state, records


def _check_optimizer_steps(optimizer: Any, steps: int) -> None:
    """ValueError when ``optimizer`` (loaded) counts more steps for a parameter than the
    run took (``steps``), or a count that is not a whole number: each optimizer step of
    the run steps the optimizer at most once."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, param in enumerate(params):
        count = optimizer.state.get(param, {}).get("step")
        if count is None:
            continue
        if isinstance(count, torch.Tensor) and count.numel() == 1:
            value = float(count.item())
        elif isinstance(count, int | float) and not isinstance(count, bool):
            value = float(count)
        else:
            value = math.nan
        if not (math.isfinite(value) and value == int(value) and 0 <= value <= steps):
            raise ValueError(
                f"optimizer state 'step' of parameter {index} is {count!r}; expected a "
                f"whole number from 0 to {steps}, the optimizer steps the run took")


def check_steps_asked(path: Path, state: TrainState, config: TrainConfig,
                      batches_per_epoch: int) -> None:
    """Refuse a resume from ``path`` whose ``--epochs`` asks for fewer optimizer steps than
    the checkpoint has done: going on would rewrite the run's metrics.jsonl and
    summary.json for fewer steps beside weights trained for more."""
    assert config.epochs is not None
    per_epoch = math.ceil(batches_per_epoch / config.accumulate)
    asked = per_epoch * config.epochs
    if state.step <= asked and state.epoch <= config.epochs:
        return
    needed = max(state.epoch, math.ceil(state.step / per_epoch))
    raise ResumeStepsError(
        f"cannot resume from {path}: it has done {state.step} optimizer steps, but --epochs "
        f"{config.epochs} asks for {asked} steps in all ({per_epoch} per epoch). A resume "
        "continues a run and never shortens one; nothing was changed. Resume with --epochs "
        f"{needed} or more (epochs={needed} in fit), or start a new run with another --out "
        "and no --resume.")
