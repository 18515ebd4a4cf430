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
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping
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
    manifest_bytes,
    meta_bytes,
    read_manifest,
    read_meta,
    torch_bytes,
)
from torchgpu.checkpoint.rng import capture_rng_state
from torchgpu.errors import CheckpointCorruptError, CheckpointError, CheckpointWriteError

MODEL_KEY, OPTIM_KEY = "model", "optim"  # the top-level entries of the DCP state


def is_sharded(directory: Path) -> bool:
    """Whether checkpoint directory ``directory`` has the sharded layout (a ``shards/``
    directory, or meta.json saying so: a checkpoint whose shards were deleted is still
    one, and loading it names what is missing)."""
    return (files.kind_of(directory / SHARDS_DIR) == "dir"
            or read_meta(directory).get("layout") == SHARDED)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP without a process group warns that it assumes one process: intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def _group() -> Any:
    """A new gloo process group of every rank (collective: every rank calls it)."""
    return torch.distributed.new_group(backend="gloo")


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def states_of(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The DCP state of ``model`` and ``optimizer``: each rank's shards under canonical
    names. An optimizer that has not stepped yet is left out (asking for its state would
    make torch initialise it with a step of zeros, which changes Adam's step count)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None or not optimizer.state:
        return {MODEL_KEY: get_model_state_dict(model)}
    model_state, optim_state = get_state_dict(model, optimizer)
    return {MODEL_KEY: model_state, OPTIM_KEY: optim_state}


def _shards_metadata(directory: Path) -> Any:
    """DCP's metadata of ``directory/shards``, checked against the manifest: readable,
    and every storage file it names listed there. A :class:`CheckpointCorruptError`
    naming the checkpoint otherwise."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    listed = read_manifest(directory)
    try:
        metadata = FileSystemReader(str(directory / SHARDS_DIR)).read_metadata()
    except Exception as error:  # any unpickling or OS error: the file is damaged
        raise CheckpointCorruptError(
            f"{files.show(directory / SHARDS_DIR / '.metadata')} cannot be read as "
            f"torch.distributed.checkpoint metadata ({type(error).__name__}: {error}); the "
            "sharded checkpoint is damaged. Use an earlier checkpoint") from None
    storage = getattr(metadata, "storage_data", None) or {}
    named = {getattr(info, "relative_path", None) for info in storage.values()}
    missing = sorted(str(name) for name in named
                     if name is not None and f"{SHARDS_DIR}/{name}" not in listed)
    if missing:
        raise CheckpointCorruptError(
            f"the shard metadata of {files.show(directory)} names {', '.join(missing[:5])}, "
            "which its manifest does not list; the sharded checkpoint is damaged. Use an "
            "earlier checkpoint")
    return metadata


def describe_shards(directory: Path) -> dict[str, Any]:
    """What ``torchgpu ckpt verify`` reports of a sharded checkpoint: its shard files,
    their total size, the world size that wrote them and the number of model and
    optimizer entries (the metadata is checked: :class:`CheckpointCorruptError`)."""
    metadata = _shards_metadata(directory)
    listed = read_manifest(directory)
    shards = {name: int(info["size_bytes"]) for name, info in listed.items()
              if name.startswith(f"{SHARDS_DIR}/")}
    keys = list(getattr(metadata, "state_dict_metadata", {}) or {})
    return {"shard_files": len(shards), "shard_bytes": sum(shards.values()),
            "world_size": read_meta(directory).get("world_size"),
            "model_entries": sum(key.startswith(f"{MODEL_KEY}.") for key in keys),
            "optimizer_entries": sum(key.startswith(f"{OPTIM_KEY}.") for key in keys)}


def model_tensors(directory: Path) -> list[tuple[str, list[int], torch.dtype]]:
    """The model's tensors in sharded checkpoint ``directory`` as its metadata records
    them (name, whole shape, dtype), read without loading any shard."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = f"{MODEL_KEY}."
    return [(key[len(prefix):], list(info.size), info.properties.dtype)
            for key, info in _shards_metadata(directory).state_dict_metadata.items()
            if key.startswith(prefix) and isinstance(info, TensorStorageMetadata)]


def load_sharded_states(directory: str | Path, model: nn.Module,
                        optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load the model (and optimizer) states of sharded checkpoint ``directory`` into
    ``model`` / ``optimizer`` on any world size: FSDP2-sharded, DDP-wrapped or plain,
    in a process group of any size or none (DCP re-shards on load). Collective when a
    process group is initialised: every rank calls it. Verify the files first
    (:func:`~torchgpu.checkpoint.layout.verify_directory`); this checks the shard
    metadata against the manifest. A state that does not fit the model is a
    :class:`CheckpointError` naming the checkpoint."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    from torchgpu.checkpoint import _dcp as dcp

    source = Path(directory)
    metadata = _shards_metadata(source)
    saved = set(getattr(metadata, "state_dict_metadata", {}) or {})
    with_optim = optimizer is not None and any(k.startswith(f"{OPTIM_KEY}.") for k in saved)
    if optimizer is not None and not with_optim and optimizer.state:
        optimizer.state.clear()  # the run saved it before its first step: a fresh state
    state = states_of(model, optimizer if with_optim else None)
    if with_optim and OPTIM_KEY not in state:  # a fresh optimizer: ask DSD to initialise it
        from torch.distributed.checkpoint.state_dict import get_state_dict

        assert optimizer is not None
        state[MODEL_KEY], state[OPTIM_KEY] = get_state_dict(model, optimizer)
    try:
        with _quiet():
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(source / SHARDS_DIR)),
                     no_dist=not _distributed())
        if with_optim:
            assert optimizer is not None
            set_state_dict(model, optimizer, model_state_dict=state[MODEL_KEY],
                           optim_state_dict=state[OPTIM_KEY])
        else:
            set_model_state_dict(model, state[MODEL_KEY])
    except _failures() as error:  # DCP wraps each rank's failure: one line of the first
        raise CheckpointError(
            f"the sharded model/optimizer state in {files.show(source)} does not fit the "
            f"model and optimizer given ({why(error)}); build them the way the run that "
            "saved it did") from None


def read_sharded_model(directory: str | Path) -> dict[str, torch.Tensor]:
    """The whole model state of sharded checkpoint ``directory`` in this process (no
    process group needed): what ``torchgpu ckpt convert`` writes as one
    ``model.safetensors``. Verify the files first."""
    from torchgpu.checkpoint import _dcp as dcp

    source = Path(directory)
    model = {name: torch.empty(shape, dtype=dtype)
             for name, shape, dtype in model_tensors(source)}
    try:
        with _quiet():
            dcp.load({MODEL_KEY: model},
                     storage_reader=dcp.FileSystemReader(str(source / SHARDS_DIR)), no_dist=True)
    except _failures() as error:
        raise CheckpointCorruptError(
            f"the model shards of {files.show(source)} cannot be read ({why(error)}); the "
            "sharded checkpoint is damaged. Use an earlier checkpoint") from None
    return model


def _failures() -> tuple[type[BaseException], ...]:
    """What a DCP save or load raises: its own ``CheckpointException`` (a BaseException
    that carries each rank's failure) and ordinary errors."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def why(error: BaseException) -> str:
    """One line for ``error``: for DCP's ``CheckpointException`` the first failing rank
    and its exception (never the traceback it carries)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        inner: Any = getattr(failures[rank], "exc", failures[rank])
        if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
            inner = inner[0]  # (exception, stack) as it crossed the ranks
        return f"rank {rank}: {why(inner)}"
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}".rstrip(": ")


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
        self._group = _group() if world > 1 and _distributed() else None
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
                with _quiet():
                    dcp.save(state, storage_writer=writer, process_group=self._group,
                             no_dist=self._group is None)
            except _failures() as failed:
                self._failed(temp, final, failed)
            return self._commit(temp, final, small, keep_last, on_commit, latest)
        try:
            upload = dcp.async_save(state, storage_writer=writer, process_group=self._group,
                                    no_dist=self._group is None)
        except _failures() as failed:
            self._failed(temp, final, failed)
        del state  # staged: the training may change the model from here on

        def finish() -> Path:
            try:
                upload.result()
            except _failures() as failed:
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
