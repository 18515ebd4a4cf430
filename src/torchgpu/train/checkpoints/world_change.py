"""Resuming a data-parallel run on another number of processes (:class:`WorldChange`).

A ``single``, ``ddp`` or ``fsdp`` run's order does not depend on the world size (epoch ``e``
is one global permutation, cut into micro-batches of ``G`` = processes x per-process batch),
so a checkpoint saved by ``W`` processes continues on ``W'`` processes of batch ``B'`` when
``B' x W'`` divides the effective batch ``E``: the accumulation becomes ``E / (B' x W')``,
every later window holds the uninterrupted run's samples, and the position converts at the
sample level. Otherwise the resume is a :class:`~torchgpu.errors.ResumeError` naming what
would fit; so is fsdp continuing the one file of ``single`` or ``ddp`` (fsdp's shards,
re-sharded on load, continue into any of the three). Model splits, pipelines and streamed
training sets (their position kept per rank) keep the world size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchgpu.checkpoint.layout import read_meta
from torchgpu.checkpoint.sharded_load import is_sharded
from torchgpu.errors import ResumeError
from torchgpu.train.config import TrainConfig
from torchgpu.train.state import TrainState

#: Strategies whose checkpoint a run of another world size can continue: the optimizer
#: state is whole on every rank and the data order is the world's global order.
DATA_PARALLEL = ("single", "ddp")
#: Strategies that continue a sharded checkpoint (fsdp's) on another world size: DCP
#: re-shards its model and optimizer state for FSDP2, DDP or one plain process alike.
SHARDED = ("single", "ddp", "fsdp")
#: The saved settings a world change may change (the effective batch stays).
LAYOUT = ("world_size", "batch_size", "accumulate", "batches_per_epoch")


@dataclass(frozen=True)
class WorldChange:
    """A resume from a checkpoint of ``saved_world`` processes x ``saved_batch`` per
    process x ``saved_accumulate`` onto ``world`` x ``batch`` x ``accumulate`` (the same
    effective batch; ``batch`` 0 with ``searched``: ``--batch-size auto`` picks it)."""

    path: Path
    saved_world: int
    saved_batch: int
    saved_accumulate: int
    world: int
    batch: int
    accumulate: int
    searched: bool = False

    @property
    def effective(self) -> int:
        """Samples per optimizer step over all processes, before and after."""
        return self.saved_world * self.saved_batch * self.saved_accumulate

    def line(self) -> str:
        """The change in one line for the run's log."""
        now = (f"{self.world} x --batch-size auto (the search keeps it)" if self.searched
               else f"{self.world} x {self.batch} x accumulate {self.accumulate}")
        return (f"note: resuming on {self.world} process(es) a run saved by "
                f"{self.saved_world}: global batch {self.effective} = {self.saved_world} x "
                f"{self.saved_batch} x accumulate {self.saved_accumulate} then, {now} now "
                "(processes x per-process batch x accumulation)")

    def apply(self, config: TrainConfig) -> TrainConfig:
        """``config`` with the accumulation (or, for ``--batch-size auto``, the effective
        batch the search keeps) that holds the saved effective batch."""
        if self.searched:
            return dataclasses.replace(config, effective_batch_size=self.effective)
        return dataclasses.replace(config, accumulate=self.accumulate,
                                   effective_batch_size=None)

    def convert(self, state: TrainState, saved_batches: int, batches: int) -> TrainState:
        """``state`` (saved at a step boundary, in the saved run's micro-batches of
        ``saved_batches`` per epoch) in this run's micro-batches (``batches`` per epoch):
        the same samples of the epoch consumed. The epoch's loss sum and count are
        rescaled alike (their mean kept), so the epoch's train loss still weighs every
        sample once; ``samples`` becomes this process's share."""
        old_g = self.saved_world * self.saved_batch
        new_g = self.world * self.batch
        if state.batch_in_epoch >= saved_batches:
            position = batches
        else:
            consumed = state.batch_in_epoch * old_g
            if consumed % new_g:
                raise ResumeError(
                    f"cannot resume from {self.path} on {self.world} process(es): it was "
                    f"saved after {consumed} samples of epoch {state.epoch + 1}, not a "
                    f"multiple of this run's {new_g} samples per micro-step, so the "
                    "position falls inside a micro-batch. Resume with the saved "
                    f"{self.saved_world} process(es) or from another checkpoint of the run.")
            position = consumed // new_g
        count = state.epoch_loss_count
        scaled = round(count * old_g / new_g) if count else 0
        scaled = max(scaled, 1) if count else 0
        mean = state.epoch_loss_sum / count if count else 0.0
        return dataclasses.replace(
            state, batch_in_epoch=position, epoch_loss_count=scaled,
            epoch_loss_sum=mean * scaled if count else state.epoch_loss_sum,
            samples=state.samples * self.saved_world // self.world)


def _int(value: object) -> int | None:
    """``value`` when it is a positive int (a saved count), else None."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def _fits(change: WorldChange) -> WorldChange:
    """``change`` with its accumulation, or the refusal when none keeps the batch."""
    effective, world = change.effective, change.world
    if change.searched:
        if effective % world:
            raise _refusal(change, f"{world} processes do not divide it")
        return change
    per_step = world * change.batch
    if effective % per_step == 0:
        return dataclasses.replace(change, accumulate=effective // per_step)
    raise _refusal(change, f"{world} process(es) x --batch-size {change.batch} = {per_step} "
                           "samples per micro-step do not divide it")


def _refusal(change: WorldChange, why: str) -> ResumeError:
    effective, world = change.effective, change.world
    worlds = [w for w in range(1, effective // change.saved_batch + 1)
              if effective % (w * change.saved_batch) == 0][:6]
    batches = ([b for b in range(1, effective // world + 1) if (effective // world) % b == 0]
               if effective % world == 0 else [])
    fix = (f"--batch-size {max(b for b in batches if b <= max(change.batch, 1))}"
           f" (any divisor of {effective // world})" if batches else "")
    fix = f"resume on {world} process(es) with {fix}, or " if fix else ""
    return ResumeError(
        f"cannot resume from {change.path} on {world} process(es): the run it continues "
        f"trained with a global batch of {effective} samples per optimizer step "
        f"({change.saved_world} process(es) x --batch-size {change.saved_batch} x "
        f"--accumulate {change.saved_accumulate}), and {why}, so no accumulation keeps "
        f"it. To continue the run, {fix}resume with --nproc "
        f"{' / '.join(str(w) for w in worlds)} and --batch-size {change.saved_batch}; "
        "or start a new run (another --out, without --resume).")


def continues(path: Path, saved_strategy: object, strategy: str, saved_world: object,
              world: object) -> bool:
    """Whether a run of ``strategy`` on ``world`` processes may continue checkpoint
    ``path`` (saved by ``saved_world`` processes of ``saved_strategy``) on that other
    world size: ``strategy`` reads its layout (:data:`SHARDED` for shards, a
    :data:`DATA_PARALLEL` one for one file). False for strategies that keep the world
    fixed (the saved settings' check refuses); ResumeError for fsdp meeting one file."""
    family = SHARDED if is_sharded(path) else DATA_PARALLEL
    if saved_strategy in family and strategy in family:
        return True
    if not (saved_strategy in DATA_PARALLEL and strategy == "fsdp"):
        return False
    raise ResumeError(
        f"cannot resume from {path} on {world} process(es) with --strategy fsdp: it was "
        f"saved by {saved_world} process(es) of --strategy {saved_strategy} as one file "
        "holding the whole optimizer state by parameter index, which fsdp's sharded "
        "optimizer cannot take (fsdp resumes from its own sharded checkpoints, which any "
        "strategy and world size can continue). Resume with --strategy ddp (any --nproc "
        "that keeps the global batch), or start a new fsdp run (another --out, without "
        f"--resume) from its weights: `torchgpu ckpt convert {path} "
        "weights.safetensors` writes them with plain keys to load in your model factory "
        "(the optimizer state and data position are not carried).")


def saved_layout(meta: Mapping[str, Any]) -> tuple[int, int, int, str] | None:
    """(world size, per-process batch, accumulation, strategy) a checkpoint's meta.json
    records, or None where it lacks one of them."""
    config = meta.get("config")
    if not isinstance(config, Mapping):
        return None
    world, batch = _int(meta.get("world_size")), _int(config.get("batch_size"))
    accumulate, strategy = _int(config.get("accumulate")), meta.get("strategy")
    if world is None or batch is None or accumulate is None or not isinstance(strategy, str):
        return None
    return world, batch, accumulate, strategy


def plan(found: Path, config: TrainConfig, world: int | None,
         strategy: str | None) -> WorldChange | None:
    """The change a resume of ``config`` on ``world`` data-parallel processes under
    ``strategy`` makes to checkpoint ``found`` (read from its meta.json), or None: the
    same world, or a strategy whose world must stay (the saved settings' check refuses
    it). ResumeError when no accumulation keeps the saved effective batch, or fsdp
    meets a one-file checkpoint (:func:`continues`)."""
    layout = saved_layout(read_meta(found))
    if world is None or strategy is None or layout is None:
        return None
    saved_world, saved_batch, saved_accumulate, saved_strategy = layout
    if saved_world == world or not continues(found, saved_strategy, strategy, saved_world,
                                             world):
        return None
    return _fits(WorldChange(found, saved_world, saved_batch, saved_accumulate, world,
                             config.batch_size or 0, config.accumulate,
                             searched=config.auto_batch_size))


def at_load(path: Path, saved: Mapping[str, Any], now: Mapping[str, Any],
            saved_strategy: object, strategy: str, streamed: bool) -> WorldChange | None:
    """The checkpoint's run fingerprint ``saved`` against this run's ``now`` (the
    settings a position depends on): the world change a load converts, or None (the
    same world, or a strategy that keeps it fixed: the saved settings' check refuses).
    ResumeError for a streamed training set, or an effective batch that differs."""
    world, saved_world = now.get("world_size"), saved.get("world_size")
    if saved_world == world or not continues(path, saved_strategy, strategy, saved_world,
                                             world):
        return None
    if any(_int(saved.get(key)) is None for key in LAYOUT):
        return None  # not a layout this module converts: the saved settings' check refuses
    if streamed:
        raise ResumeError(
            f"cannot resume from {path} on {world} process(es): it was saved by "
            f"{saved_world}, and a streamed training set's position is kept per rank, so it "
            f"cannot be split over another number of processes. Resume with --nproc "
            f"{saved_world}, or start a new run (another --out, without --resume).")
    change = WorldChange(path, int(saved["world_size"]), int(saved["batch_size"]),
                         int(saved["accumulate"]), int(now["world_size"]),
                         int(now["batch_size"]), int(now["accumulate"]))
    if change.world * change.batch * change.accumulate != change.effective:
        raise _refusal(change, f"{change.world} process(es) x --batch-size {change.batch} x "
                               f"--accumulate {change.accumulate} make another")
    return change


def check_asked(change: WorldChange, asked: int | None, config: TrainConfig) -> TrainConfig:
    """``config``, unless ``--effective-batch-size`` (``asked``) names another effective
    batch than the run ``change`` continues trained with: then ResumeError."""
    if asked is None or asked == change.effective:
        return config
    raise ResumeError(
        f"cannot resume from {change.path} with --effective-batch-size {asked}: the run it "
        f"continues trained with {change.effective} samples per optimizer step, and its "
        "data position and optimizer state mean that batch. Resume with "
        f"--effective-batch-size {change.effective} (or without it), or start a new run "
        "(another --out, without --resume).")
