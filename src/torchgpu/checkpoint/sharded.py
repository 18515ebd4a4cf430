"""Sharded checkpoints: every rank writes its own shards with torch.distributed.checkpoint.

**Layout.** A sharded checkpoint directory holds ``state.pt`` and ``meta.json`` as the
single-file format does (step, epoch, scheduler, scaler, RNG, ``extra``: the training
position), ``shards/`` with the model and optimizer states as
``torch.distributed.checkpoint`` (DCP) wrote them (``shards/.metadata`` and each rank's
``.distcp`` files) and ``manifest.json``, written last, listing every file with its size
and sha256 (``"layout": "sharded"``; each rank hashes the files it wrote). meta.json
says ``"layout": "sharded"`` too. The model and optimizer states are the ones
``torch.distributed.checkpoint.state_dict.get_state_dict`` gives (canonical names, no
wrapper prefixes), so they load into a model of any wrapping and any world size
(:func:`load_sharded_states`: DCP re-shards on load).

**Atomicity.** Rank 0 picks a temporary sibling ``.NAME.tmp-HOST-PID-RAND`` (the name
:mod:`torchgpu.checkpoint.atomic` uses, so a dead writer's leftover is cleaned up like
any other), every rank writes its shards into it, and once all of them finished (the
collective that gathers their hashes) rank 0 writes state.pt, meta.json and the
manifest, fsyncs and renames the directory into place, then updates ``latest`` and
prunes. A crash or an error before the rename leaves the previous checkpoint the newest
complete one; a failed write removes the temporary and is a
:class:`~torchgpu.errors.CheckpointWriteError` on every rank.

**Async.** With ``async_save`` the state is copied to host memory at the step boundary
(DCP's ``async_save`` staging) and written while training goes on; the next save (and
:meth:`ShardedSaver.wait`) first waits for the previous one, so at most one copy is held.
Its collectives run on a process group of their own (gloo), never on the one the
training step uses.

Reading (:mod:`torchgpu.checkpoint.sharded_load`, re-exported here):
:func:`load_sharded_states` into a model and optimizer of any world size,
:func:`read_sharded_model` (the whole model in one process), :func:`describe_shards`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchgpu.checkpoint import atomic, files
from torchgpu.checkpoint.discover import LATEST, prune
from torchgpu.checkpoint.layout import (
    FORMAT,
    MANIFEST_FILE,
    META_FILE,
    SHARDED,
    SHARDS_DIR,
    STATE_FILE,
    check_weights_only_safe,
    meta_bytes,
    torch_bytes,
)
from torchgpu.checkpoint.manifest import manifest_bytes
from torchgpu.checkpoint.rng import capture_rng_state
from torchgpu.checkpoint.sharded_load import (
    MODEL_KEY,
    OPTIM_KEY,
    describe_shards,
    distributed,
    failures,
    is_sharded,
    load_sharded_states,
    model_tensors,
    quiet,
    read_sharded_model,
    states_of,
    why,
)
from torchgpu.errors import CheckpointError, CheckpointWriteError

__all__ = ["MODEL_KEY", "OPTIM_KEY", "ShardedSaver", "describe_shards", "is_sharded",
           "load_sharded_states", "model_tensors", "read_sharded_model",
           "save_sharded_weights", "states_of", "why"]


def _group() -> Any:
    """A new gloo process group of every rank (collective: every rank calls it)."""
    return torch.distributed.new_group(backend="gloo")


def _hash_files(shards: Path, names: list[str]) -> dict[str, dict[str, object]]:
    """The manifest entries (``shards/NAME``: size and sha256) of ``names`` in ``shards``."""
    entries: dict[str, dict[str, object]] = {}
    for name in names:
        digest, size = hashlib.sha256(), 0
        with open(shards / name, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 22), b""):
                digest.update(block)
                size += len(block)
        entries[f"{SHARDS_DIR}/{name}"] = {"sha256": digest.hexdigest(), "size_bytes": size}
    return entries


def _own_files(shards: Path, rank: int, world: int) -> list[str]:
    """The shard files this rank hashes: the ``__RANK_*.distcp`` it wrote; rank 0 also
    ``.metadata`` and any file no rank's pattern claims."""
    names = sorted(entry.name for entry in shards.iterdir() if entry.is_file())
    mine = [n for n in names if n.startswith(f"__{rank}_")]
    if rank == 0:
        claimed = {n for n in names for r in range(world) if n.startswith(f"__{r}_")}
        mine += [n for n in names if n not in claimed]
    return mine


def _fsync_tree(directory: Path) -> None:
    for sub in (directory / SHARDS_DIR, directory):
        if sub.is_dir():
            atomic.fsync_dir(sub)


def _rename_into_place(temp: Path, final: Path) -> None:
    """``temp`` becomes ``final``; an existing ``final`` is moved aside first and deleted
    after (a crash between the renames leaves it as ``.NAME.old-*``, which
    :func:`~torchgpu.checkpoint.atomic.clean_orphans` puts back)."""
    aside = None
    if files.exists(final):
        aside = final.parent / f".{final.name}.old-{atomic.token()}"
        os.rename(final, aside)
    try:
        os.rename(temp, final)
    except BaseException:
        if aside is not None:
            os.rename(aside, final)
        raise
    atomic.fsync_dir(final.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


class ShardedSaver:
    """Writes the sharded checkpoints of one run (see the module docstring).

    Every rank builds one (collective: it makes the saver's own process group when
    several ranks run) and calls :meth:`save` at the same steps; :meth:`wait` before
    reading what was saved and before the process ends. ``on_commit(path)`` is called on
    every rank once a checkpoint is in place.
    """

    def __init__(self, *, rank: int, world: int, async_save: bool = False) -> None:
        self.rank, self.world, self.async_save = rank, world, async_save
        self._group = _group() if world > 1 and distributed() else None
        self._executor = (ThreadPoolExecutor(1, thread_name_prefix="torchgpu-sharded-save")
                          if async_save else None)
        self._pending: Future[Path] | None = None

    # -- collectives on the saver's own group -------------------------------------------
    def _broadcast(self, value: Any) -> Any:
        if self._group is None:
            return value
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def _gather(self, value: Any) -> list[Any]:
        if self._group is None:
            return [value]
        out: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(out, value, group=self._group)
        return out

    # -- saving ------------------------------------------------------------------------
    def wait(self) -> Path | None:
        """Wait for the save in flight (if any); its error is raised here."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def save(self, final: Path, *, model: nn.Module | None,
             optimizer: torch.optim.Optimizer | None, scheduler: Any = None,
             scaler: Any = None, step: int, epoch: int,
             extra: Mapping[str, object] | None = None,
             meta: Mapping[str, object] | None = None, keep_last: int | None = None,
             on_commit: Callable[[Path], None] | None = None,
             weights: Mapping[str, torch.Tensor] | None = None, latest: bool = True) -> Path:
        """Write the sharded checkpoint ``final`` (collective). Synchronous, or with
        ``async_save`` started and committed in the background (:meth:`wait`).
        ``model=None``: the model state is ``weights`` (a whole state dict, one process).
        ``latest``: point ``final.parent/latest`` at it (not for a run's final model)."""
        from torchgpu.checkpoint import _dcp as dcp

        self.wait()
        steps = self._gather(int(step))
        if len(set(steps)) > 1:
            raise CheckpointError(
                f"ranks disagree on the step to save: {steps}. Every rank must save at the "
                "same step; save only at agreed step boundaries")
        small: dict[str, bytes] = {}
        temp_name: str | None = None
        error: str | None = None
        if self.rank == 0:
            try:
                small = self._small_files(final, scheduler, scaler, step, epoch, extra, meta)
                atomic.make_parent(final.parent)
                atomic.clean_orphans(final.parent)
                temp = final.parent / f".{final.name}.tmp-{atomic.token()}"
                (temp / SHARDS_DIR).mkdir(parents=True)
                temp_name = temp.name
            except (CheckpointError, OSError) as failed:
                error = str(failed)
        temp_name, error = self._broadcast((temp_name, error))
        if error is not None:
            raise CheckpointWriteError(error if self.rank == 0 else
                                       f"rank 0 could not start the checkpoint: {error}")
        assert temp_name is not None
        temp = final.parent / temp_name
        state = (states_of(model, optimizer) if model is not None
                 else {MODEL_KEY: dict(weights or {})})
        writer = dcp.FileSystemWriter(str(temp / SHARDS_DIR))
        if self._executor is None:
            try:
                with quiet():
                    dcp.save(state, storage_writer=writer, process_group=self._group,
                             no_dist=self._group is None)
            except failures() as failed:
                self._failed(temp, final, failed)
            return self._commit(temp, final, small, keep_last, on_commit, latest)
        try:
            # no_dist only where there is no group (keyword of newer torch releases)
            alone: dict[str, Any] = {"no_dist": True} if self._group is None else {}
            upload = dcp.async_save(state, storage_writer=writer, process_group=self._group,
                                    **alone)
        except failures() as failed:
            self._failed(temp, final, failed)
        del state  # staged: the training may change the model from here on

        def finish() -> Path:
            try:
                upload.result()
            except failures() as failed:
                self._failed(temp, final, failed)
            return self._commit(temp, final, small, keep_last, on_commit, latest)

        assert self._executor is not None
        self._pending = self._executor.submit(finish)
        return final

    def _small_files(self, final: Path, scheduler: Any, scaler: Any, step: int, epoch: int,
                     extra: Mapping[str, object] | None,
                     meta: Mapping[str, object] | None) -> dict[str, bytes]:
        """state.pt and meta.json (rank 0), captured at the step boundary."""
        state = {
            "format": FORMAT, "layout": SHARDED, "step": int(step), "epoch": int(epoch),
            "optimizer": None,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "scaler": scaler.state_dict() if scaler is not None else None,
            "rng": capture_rng_state(), "extra": dict(extra or {}), "model_extra": {},
        }
        for key in ("scheduler", "scaler", "extra"):
            check_weights_only_safe(state[key], key)
        return {STATE_FILE: torch_bytes(state),
                META_FILE: meta_bytes({**(meta or {}), "layout": SHARDED}, step=int(step),
                                      epoch=int(epoch), world_size=self.world)}

    def _failed(self, temp: Path, final: Path, error: BaseException) -> None:
        """A rank's write failed (DCP reports it on every rank): remove the temporary,
        raise the one-paragraph error."""
        if self.rank == 0:
            shutil.rmtree(temp, ignore_errors=True)
        raise CheckpointWriteError(
            f"writing the sharded checkpoint {files.show(final)} failed ({why(error)}). Nothing "
            "was committed: the previous checkpoint is still the newest; fix the cause "
            "(disk space, permissions) and run again") from None

    def _commit(self, temp: Path, final: Path, small: Mapping[str, bytes],
                keep_last: int | None, on_commit: Callable[[Path], None] | None,
                latest: bool = True) -> Path:
        """After every rank wrote its shards: hash them (each rank its own), then rank 0
        publishes the checkpoint; every rank learns the outcome."""
        shards = temp / SHARDS_DIR
        problem: str | None = None
        try:
            hashed = _hash_files(shards, _own_files(shards, self.rank, self.world))
        except OSError as error:
            hashed, problem = {}, f"rank {self.rank} could not read its shards back: {error}"
        gathered = self._gather((hashed, problem))
        problems = [p for _, p in gathered if p is not None]
        if self.rank == 0 and not problems:
            try:
                entries: dict[str, Mapping[str, object]] = {}
                for part, _ in gathered:
                    entries.update(part)
                for name, data in small.items():
                    atomic.write_file(temp / name, data)
                atomic.write_file(temp / MANIFEST_FILE, manifest_bytes(small, hashed=entries))
                _fsync_tree(temp)
                _rename_into_place(temp, final)
                if latest:
                    atomic.write_pointer(final.parent, final.name, LATEST)
                if keep_last is not None:
                    prune(final.parent, keep_last, protect=final)
            except (CheckpointError, OSError) as error:
                problems.append(str(error))
        if self.rank == 0 and problems:
            shutil.rmtree(temp, ignore_errors=True)
        outcome = self._broadcast(problems[0] if problems else None)
        if outcome is not None:
            raise CheckpointWriteError(
                f"committing the sharded checkpoint {files.show(final)} failed ({outcome}). "
                "The previous checkpoint is still the newest; fix the cause and run again")
        if on_commit is not None:
            on_commit(final)
        return final

    def close(self) -> None:
        """Wait for the save in flight and stop the background thread."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            if self._group is not None:
                with contextlib.suppress(Exception):
                    torch.distributed.destroy_process_group(self._group)
                self._group = None


def save_sharded_weights(final: str | Path, weights: Mapping[str, torch.Tensor],
                         meta: Mapping[str, object] | None = None) -> Path:
    """Write ``weights`` (a whole model state dict, in this process) as a sharded
    checkpoint directory ``final`` that holds no training state: what ``torchgpu ckpt
    convert --format dcp`` writes, loadable into a model on any world size
    (:func:`load_sharded_states`, ``torchgpu.load_checkpoint``) and back to one file."""
    saver = ShardedSaver(rank=0, world=1)
    return saver.save(Path(final), model=None, optimizer=None, step=0, epoch=0,
                      meta=meta, weights=weights, latest=False)
