"""A run's checkpoints: :class:`RunCheckpoints` saves them and resumes from one, exactly.

Saves ``OUT/checkpoints/step-SSSSSSSS`` every ``--save-every`` optimizer steps (atomic;
``latest`` moves after the commit; ``--keep-last`` prunes), and always at the boundary where
a stop ends the run, which then exits 0 with the resume command (torchrun restarts a group
only after a non-zero exit). A resume is exact: on CPU bitwise equal to the uninterrupted
run (states, RNGs, the epoch's order and position, ``metrics.jsonl``). A checkpoint that
does not verify is skipped for the newest that does when reached through ``latest``, and
refused when named; checkpoints past the resumed step are moved aside whole, never deleted.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchgpu.checkpoint import (
    LoadedCheckpoint,
    capture_rng_state,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from torchgpu.checkpoint.atomic import write_pointer
from torchgpu.checkpoint.discover import (
    LATEST,
    find_checkpoint,
    later_checkpoints,
    newest_verified,
    set_aside,
)
from torchgpu.checkpoint.sharded import ShardedSaver
from torchgpu.checkpoint.sharded_load import is_sharded
from torchgpu.collectives import gather_objects
from torchgpu.errors import CheckpointCorruptError, ResumeError
from torchgpu.launch.heartbeat import Heartbeat
from torchgpu.launch.stop_record import StopFlag
from torchgpu.train.checkpoints import world_change
from torchgpu.train.checkpoints.autoresume import continue_hint
from torchgpu.train.checkpoints.history import history_lines
from torchgpu.train.checkpoints.resume_plan import FIXED, ResumePlan, cannot_resume, checkpoints_dir
from torchgpu.train.checkpoints.run_start import DataPosition, Ranks
from torchgpu.train.checkpoints.saved_position import (
    check_steps_asked,
    saved_position,
)
from torchgpu.train.config import TrainConfig
from torchgpu.train.loop import epoch as loop
from torchgpu.train.outputs import files as outputs
from torchgpu.train.outputs.files import EpochRecord, MetricsBuffer
from torchgpu.train.schedule import FIXED as SCHEDULE_FIXED
from torchgpu.train.state import TrainState


def _refuse_whole(source: Path) -> None:
    """A sharded run (fsdp) resumes from sharded checkpoints only: a single-file one
    (ddp, single) holds its optimizer state by parameter index, which a sharded
    optimizer cannot take."""
    found = find_checkpoint(source)
    if found is not None and (found / "model.safetensors").exists() and not is_sharded(found):
        raise ResumeError(
            f"{found} is a single-file checkpoint (written by --strategy ddp or single), and "
            "--strategy fsdp resumes from sharded checkpoints only. Resume it with the "
            "strategy that wrote it, or start the fsdp run from its weights (load them with "
            "torchgpu.load_state_dict in your model factory).")


class RunCheckpoints:
    """Saving and restoring one ``torchgpu train`` run.

    ``model`` and ``optimizer`` are what is saved and restored; where they are spread
    over the ranks, ``before_save`` (every rank, before each save) gathers them so that
    rank 0's ``model.state_dict()`` / ``optimizer.state_dict()`` hold the whole run.
    The runner builds it once, calls :meth:`begin` (fresh or resumed state),
    :meth:`start_epoch` instead of ``loop.start_epoch``, passes ``step_hook`` as
    the loop's ``on_step``, and calls ``stopped`` when the loop stopped early.
    Every rank calls every method (saves are collective under DDP); only rank 0 writes.
    """

    def __init__(self, config: TrainConfig, *, model: nn.Module, optimizer: Any,
                 precision: Any, ranks: Ranks, records: list[EpochRecord], stop: StopFlag,
                 batches_per_epoch: int, mode: str, out_dir: Path | None,
                 scheduler: Any = None,
                 sync: Callable[[], bool] | None = None,
                 heartbeat: Heartbeat | None = None,
                 before_save: Callable[[], None] | None = None,
                 files: Mapping[str, str] | None = None,
                 data: DataPosition | None = None, sharded: bool = False) -> None:
        assert config.out is not None
        self.config = config
        self.data = data  # a stream's loader: its position is saved per rank
        self.directory = checkpoints_dir(config.out)
        self.model, self.optimizer, self.precision = model, optimizer, precision
        self.scheduler = scheduler
        self.ranks, self.records, self.stop = ranks, records, stop
        self.mode, self.out_dir = mode, out_dir
        # The loop's sync_now for this run (DDP agreement at a boundary); None: one process.
        self.sync = sync
        self.heartbeat = heartbeat  # marks the checkpoint's collectives (hang reports)
        # Every rank, before each save: state spread over the ranks (the stage pipeline's
        # weights and optimizer states) is gathered to rank 0, which writes.
        self.before_save = before_save
        self.save_every = config.save_every
        # the sha256 of the run's files by path, in every checkpoint's meta.json: a
        # resume compares them (torchgpu.train.checkpoints.resume_plan)
        self.files = dict(files or {})
        self.batches_per_epoch = batches_per_epoch
        self.last_saved: Path | None = None
        self.last_saved_step: int | None = None
        self.resumed_from: Path | None = None
        # Held while a checkpoint is written: a stop's deadline lets the write finish
        # before it ends the process (torchgpu.train.guards.stop_deadline).
        self.saving = threading.Lock()
        self.fingerprint: dict[str, Any] = {
            "run_name": config.run_name, "example": config.example, "data": config.data,
            "target": config.target, "data_size": config.data_size, "seed": config.seed,
            "batch_size": config.batch_size, "accumulate": config.accumulate, "lr": config.lr,
            "world_size": ranks.world_size, "batches_per_epoch": batches_per_epoch,
            **{key: getattr(config, key) for key in SCHEDULE_FIXED},
        }
        # sharded: every rank writes its shards (--strategy fsdp), synchronously or with
        # --async-save in the background; collective (the saver's own process group)
        self.shards = (ShardedSaver(rank=ranks.rank, world=ranks.world_size,
                                    async_save=config.async_save) if sharded else None)
        if config.async_save and not sharded and out_dir is not None:
            print("note: --async-save applies to sharded checkpoints (--strategy fsdp with "
                  "several processes); this run writes its checkpoints at the step boundary",
                  file=sys.stderr)
        self._epoch_rng: torch.Tensor | None = None  # torch RNG as this epoch's loader began
        self._pending: tuple[torch.Tensor | None, dict[str, Any]] | None = None

    # -- starting ---------------------------------------------------------------------

    def begin(self, plan: ResumePlan) -> TrainState:
        """The state the run starts from: fresh, or loaded from ``plan.source`` (rank 0's
        choice, broadcast). Rank 0 prints the plan's notes and rewrites metrics.jsonl."""
        source = plan.source
        if self.ranks.is_distributed:
            from torchgpu.collectives import broadcast_object

            source = broadcast_object(source, src=0)
        if self.out_dir is not None:
            for note in plan.notes:
                print(note, file=sys.stderr)
        state = TrainState() if source is None else self._load(source, plan.named)
        if self.out_dir is not None and plan.continuing:
            from torchgpu.checkpoint.atomic import write_file_atomic

            lines = history_lines(state, self.records)
            write_file_atomic(self.out_dir / outputs.METRICS_FILE,
                              "".join(line + "\n" for line in lines).encode())
        return state

    def _read(self, source: Path) -> LoadedCheckpoint:
        if self.shards is not None and self.mode == "fsdp":  # one process: a plain model
            _refuse_whole(source)
        return load_checkpoint(source, model=self.model, optimizer=self.optimizer,
                               scheduler=self.scheduler, scaler=self.precision,
                               restore_rng=False, trust=self.config.trust_checkpoint)

    def _read_or_fall_back(self, source: Path, named: bool) -> LoadedCheckpoint:
        """Load ``source``; if its bytes do not match its manifest (checked before anything
        is restored), fall back to the newest checkpoint beside it that verifies, unless
        ``source`` was named explicitly: then the error names that checkpoint."""
        try:
            return self._read(source)
        except CheckpointCorruptError as error:
            fallback = newest_verified(source.parent, exclude=source)
            if named or fallback is None:
                hint = (f" The newest checkpoint that verifies is {fallback}: resume with "
                        f"--resume {fallback}" if fallback is not None else "")
                raise CheckpointCorruptError(f"{error}.{hint}") from None
            if self.out_dir is not None:
                print(f"note: {error}. Resuming from the newest checkpoint that verifies "
                      f"instead: {fallback}", file=sys.stderr)
            return self._read(fallback)

    def _set_aside_later(self, loaded: Path, step: int) -> None:
        """Move this run's checkpoints above ``step`` (an abandoned branch) aside; rank 0."""
        later = later_checkpoints(self.directory, step)
        if not later:
            return
        aside = set_aside(self.directory, later, f"step-{step:08d}")
        if loaded.parent.resolve() == self.directory.resolve():
            write_pointer(self.directory, loaded.name, LATEST)
        print(f"note: resuming from step {step} abandons the later checkpoints "
              f"{', '.join(p.name for p in later)} in {self.directory}; they were moved to "
              f"{aside} (delete it when no longer needed), and `latest` names the newest "
              "checkpoint of this run from now on", file=sys.stderr)

    def _load(self, source: Path, named: bool = False) -> TrainState:
        loaded = self._read_or_fall_back(source, named)
        if len(set(gather_objects(str(loaded.path)))) > 1:
            raise ResumeError(
                f"the ranks loaded different checkpoints (rank {self.ranks.rank}: "
                f"{loaded.path}); a damaged checkpoint read differently on some rank. Resume "
                "with --resume naming one checkpoint that `torchgpu ckpt verify` accepts.")
        extra = loaded.extra
        if "train_state" not in extra:
            raise ResumeError(
                f"{loaded.path} holds no training position (it was not written by `torchgpu "
                "train`), so the run cannot continue exactly from it: resume from a checkpoint "
                "of `torchgpu train`, or load its weights with torchgpu.load_checkpoint."
            )
        saved = dict(extra.get("run") or {})
        # another number of data-parallel processes: the effective batch must stay
        change = world_change.at_load(loaded.path, saved, self.fingerprint,
                                      loaded.meta.get("strategy"), self.mode,
                                      bool(extra.get("data_position_per_rank")))
        keep = world_change.LAYOUT if change is not None else ()
        changed = [f"{key} {saved.get(key)!r} -> {self.fingerprint[key]!r}"
                   for key in (*FIXED, *SCHEDULE_FIXED)
                   if key in saved and key not in keep and saved[key] != self.fingerprint[key]]
        if changed:
            raise cannot_resume(loaded.path, changed)
        state = self._saved_state(loaded.path, extra, change, saved)
        check_steps_asked(loaded.path, state, self.config, self.batches_per_epoch)
        rngs = list(extra.get("rng_per_rank") or [])
        epoch_rngs = list(extra.get("epoch_rng_per_rank") or [])
        rank = self.ranks.rank
        rng = rngs[rank] if rank < len(rngs) else {}
        epoch_rng = epoch_rngs[rank] if rank < len(epoch_rngs) else None
        self._pending = (epoch_rng, rng)
        positions = list(extra.get("data_position_per_rank") or [])
        if self.data is not None and rank < len(positions):
            self.data.resume_from(positions[rank])
        self.last_saved, self.last_saved_step = loaded.path, state.step
        self.resumed_from = loaded.path
        if self.out_dir is not None:
            if change is not None:
                print(change.line(), file=sys.stderr)
            print(f"resuming from {loaded.path}: step {state.step}, epoch {state.epoch + 1}, "
                  f"batch {state.batch_in_epoch}", file=sys.stderr)
            self._set_aside_later(loaded.path, state.step)
        return state

    def _saved_state(self, path: Path, extra: Mapping[str, Any],
                     change: world_change.WorldChange | None = None,
                     saved: Mapping[str, Any] | None = None) -> TrainState:
        """The checkpoint's position, checked (:func:`saved_position`); its epoch records
        go into ``self.records``. With a world ``change`` the position is checked in the
        saved run's micro-batches (``saved``: its fingerprint), then converted."""
        if change is None or saved is None:
            state, records = saved_position(path, extra, self.batches_per_epoch,
                                            self.config.accumulate, self.optimizer)
        else:
            saved_batches = int(saved["batches_per_epoch"])
            state, records = saved_position(path, extra, saved_batches,
                                            change.saved_accumulate, self.optimizer)
            state = change.convert(state, saved_batches, self.batches_per_epoch)
        self.records[:] = records
        return state

    def start_epoch(self, loader: Iterable[Any], seed: int, epoch: int,
                    skip: int = 0) -> loop.EpochBatches:
        """:func:`loop.start_epoch`, recording the RNG the loader's iterator starts from;
        on the resumed epoch, replaying it and then restoring the RNG of the save."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] is not None:
            torch.set_rng_state(pending[0])
        self._epoch_rng = torch.get_rng_state()
        batches = loop.start_epoch(loader, seed, epoch, skip)
        if pending is not None and pending[1]:
            # After the iterator drew its base seed: the RNG continues where the save was.
            restore_rng_state(pending[1])
        return batches

    # -- during the run ---------------------------------------------------------------

    def saves_at(self, step: int) -> bool:
        """Whether ``on_step`` saves after optimizer step ``step`` (``--save-every``)."""
        return self.save_every is not None and step % self.save_every == 0

    def step_hook(self) -> Callable[[TrainState], None] | None:
        """The loop's ``on_step``, or ``None`` when nothing happens per step."""
        if self.save_every is None:
            return None
        return self.on_step

    def on_step(self, state: TrainState) -> None:
        """After every optimizer step: save every ``--save-every`` steps.

        Under DDP the loop agrees on losses and the stop flag only now and then; before a
        save every rank calls ``sync`` (:func:`loop.sync_now`) here (the same steps on
        every rank, so the collective matches) so the checkpoint holds the global loss
        history."""
        if not self.saves_at(state.step):
            return
        if self.sync is not None:
            self.sync()
        self.save(state, finish=False)  # an async save goes on in the background

    def save(self, state: TrainState, finish: bool = True) -> Path:
        """Write the checkpoint of ``state`` (collective under DDP; rank 0 writes; sharded:
        every rank writes its shards). ``finish``: return once it is committed (an async
        sharded save otherwise goes on in the background)."""
        with self.saving:
            if self.heartbeat is None:
                path = self._save(state)
            else:
                with self.heartbeat.during("checkpoint"):
                    path = self._save(state)
            if finish:
                self.finish()
            return path

    def finish(self) -> None:
        """Wait for a sharded save still being written (its error is raised here)."""
        if self.shards is not None:
            self.shards.wait()

    def close(self) -> None:
        """At the run's end (every rank): finish the save in flight, release the saver."""
        if self.shards is not None:
            self.shards.close()

    def _committed(self, path: Path) -> None:
        self.last_saved = path

    def _save(self, state: TrainState) -> Path:
        if self.before_save is not None:
            self.before_save()
        rng = capture_rng_state()
        epoch_rng = self._epoch_rng if self._epoch_rng is not None else rng["torch"]
        position = (self.data.position_state(state.epoch, state.batch_in_epoch)
                    if self.data is not None else None)
        gathered = gather_objects((rng, epoch_rng, position))
        extra: dict[str, Any] = {
            "train_state": state.to_dict(),
            "epochs": [record.as_dict() for record in self.records],
            "rng_per_rank": [g[0] for g in gathered],
            "epoch_rng_per_rank": [g[1] for g in gathered],
            "run": dict(self.fingerprint),
        }
        if any(g[2] is not None for g in gathered):
            extra["data_position_per_rank"] = [g[2] for g in gathered]
        meta = {"config": dataclasses.asdict(self.config), "strategy": self.mode,
                "position": {"epoch": state.epoch, "batch_in_epoch": state.batch_in_epoch},
                "fingerprints": self.files}
        final = self.directory / f"step-{state.step:08d}"
        if self.shards is not None:
            self.last_saved_step = state.step  # committed (last_saved) when written
            return self.shards.save(
                final, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                scaler=self.precision, step=state.step, epoch=state.epoch, extra=extra,
                meta=meta, keep_last=self.config.keep_last, on_commit=self._committed)
        path = save_checkpoint(
            final, model=self.model,
            optimizer=self.optimizer, scheduler=self.scheduler, scaler=self.precision,
            step=state.step, epoch=state.epoch, extra=extra, meta=meta,
            keep_last=self.config.keep_last, dist=self.ranks)
        self.last_saved, self.last_saved_step = path, state.step
        return path

    def stopped(self, state: TrainState, buffer: MetricsBuffer, batches_per_epoch: int) -> None:
        """The loop stopped at a step boundary: save (unless this step is saved), flush the
        buffered step lines, and tell the user how to resume (rank 0)."""
        if not self.stop.is_set():  # the stop was agreed from another rank's flag
            self.stop.set("a stop on another rank")
        if self.last_saved_step != state.step:
            self.save(state)
        self.finish()  # this step's save may still be written in the background
        if self.out_dir is None:
            return
        outputs.append_lines(self.out_dir / outputs.METRICS_FILE, buffer.take_lines())
        print(
            f"stopped by {self.stop.signal_name or 'request'} after step {state.step} (epoch "
            f"{state.epoch + 1}, batch {state.batch_in_epoch} of {batches_per_epoch}); "
            f"checkpoint: {self.last_saved}. To continue, {continue_hint(self.config)}.",
            file=sys.stderr)

    def summary(self) -> dict[str, Any]:
        """The summary's ``checkpoints`` entry."""
        return {"checkpoints": {
            "directory": str(self.directory),
            "last": str(self.last_saved) if self.last_saved is not None else None,
            "resumed_from": str(self.resumed_from) if self.resumed_from is not None else None,
        }}
