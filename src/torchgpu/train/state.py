"""Where a run stands (``TrainState``): everything a resumed run needs besides the weights,
optimizer and RNG.

Which epoch, how many optimizer steps, how many micro-batches of the current epoch were
consumed, and the loss history. An epoch's data order is a function of ``(seed, epoch)``,
so a resumed run re-creates it and skips ``batch_in_epoch`` micro-batches. A leaf: every
layer of the engine reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainState:
    """The resumable position of a run (mutable; the loop advances it).

    ``step``: optimizer steps taken. ``batch_in_epoch``: micro-batches of ``epoch``
    already consumed (0 at an epoch start). ``step_losses``: mean loss of each optimizer
    step, in order; ``step_lrs``: the learning rate each step used (the first parameter
    group's; :mod:`torchgpu.train.schedule`). ``epoch_losses``: (train, test) loss per
    finished epoch.
    """

    epoch: int = 0
    step: int = 0
    batch_in_epoch: int = 0
    samples: int = 0  # training samples seen by this process
    skipped_steps: int = 0  # optimizer steps dropped for a non-finite loss
    epoch_start_step: int = 0  # value of ``step`` when ``epoch`` began
    epoch_loss_sum: float = 0.0  # sum of this epoch's finite micro-batch losses so far
    epoch_loss_count: int = 0
    step_losses: list[float] = field(default_factory=list)
    step_lrs: list[float] = field(default_factory=list)
    epoch_losses: list[tuple[float, float]] = field(default_factory=list)

    def begin_epoch(self, epoch: int) -> None:
        """Move to the start of ``epoch`` (fresh position and epoch-loss sums)."""
        self.epoch = epoch
        self.batch_in_epoch = 0
        self.epoch_start_step = self.step
        self.epoch_loss_sum = 0.0
        self.epoch_loss_count = 0

    def to_dict(self) -> dict[str, Any]:
        """Plain values only (ints, floats, lists): safe for weights-only loading."""
        return {
            "epoch": self.epoch,
            "step": self.step,
            "batch_in_epoch": self.batch_in_epoch,
            "samples": self.samples,
            "skipped_steps": self.skipped_steps,
            "epoch_start_step": self.epoch_start_step,
            "epoch_loss_sum": self.epoch_loss_sum,
            "epoch_loss_count": self.epoch_loss_count,
            "step_losses": list(self.step_losses),
            "step_lrs": list(self.step_lrs),
            "epoch_losses": [list(pair) for pair in self.epoch_losses],
        }

    @classmethod
    def from_saved(cls, data: object) -> TrainState:
        """:meth:`from_dict` of what a checkpoint holds, checked first: a ``ValueError``
        whose message names the first field that is not what :meth:`to_dict` writes
        (``step_losses is a str; expected a list of numbers...``), so a damaged state
        is refused before the run uses it."""
        if not isinstance(data, dict):
            raise ValueError(f"train_state is a {type(data).__name__}; expected a dict "
                             "of the run's position")
        for name in ("epoch", "step", "batch_in_epoch", "samples", "skipped_steps",
                     "epoch_start_step", "epoch_loss_count"):
            value = data.get(name, None if name in ("epoch", "step", "batch_in_epoch") else 0)
            if not _count(value):
                raise ValueError(f"train_state.{name} is {_shown(value)}; expected a "
                                 "non-negative integer")
        if not _number(data.get("epoch_loss_sum", 0.0)):
            raise ValueError(f"train_state.epoch_loss_sum is "
                             f"{_shown(data.get('epoch_loss_sum'))}; expected a number")
        losses = data.get("step_losses", [])
        if not isinstance(losses, list) or not all(_number(v) for v in losses):
            raise ValueError(f"train_state.step_losses is {_shown(losses)}; expected a list "
                             "of numbers, the mean loss of each optimizer step")
        if len(losses) != data["step"]:
            raise ValueError(f"train_state.step is {data['step']} but train_state."
                             f"step_losses holds {len(losses)} losses; expected one per "
                             "optimizer step")
        pairs = data.get("epoch_losses", [])
        if not isinstance(pairs, list) or not all(
                isinstance(p, list | tuple) and len(p) == 2 and all(_number(v) for v in p)
                for p in pairs):
            raise ValueError(f"train_state.epoch_losses is {_shown(pairs)}; expected a list "
                             "of (train, test) loss pairs, one per finished epoch")
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainState:
        return cls(
            epoch=int(data["epoch"]),
            step=int(data["step"]),
            batch_in_epoch=int(data["batch_in_epoch"]),
            samples=int(data.get("samples", 0)),
            skipped_steps=int(data.get("skipped_steps", 0)),
            epoch_start_step=int(data.get("epoch_start_step", 0)),
            epoch_loss_sum=float(data.get("epoch_loss_sum", 0.0)),
            epoch_loss_count=int(data.get("epoch_loss_count", 0)),
            step_losses=[float(v) for v in data.get("step_losses", [])],
            step_lrs=[float(v) for v in data.get("step_lrs", [])],
            epoch_losses=[(float(a), float(b)) for a, b in data.get("epoch_losses", [])],
        )


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _shown(value: object) -> str:
    """``value`` for a message: its type and, when short, itself."""
    text = repr(value)
    return f"{type(value).__name__} {text}" if len(text) <= 40 else f"a {type(value).__name__}"
