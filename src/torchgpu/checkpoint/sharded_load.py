"""Reading sharded checkpoints (:mod:`torchgpu.checkpoint.sharded` writes them): their
layout, the DCP metadata checked against the manifest, the model and optimizer states
loaded on any world size, the whole model gathered in one process."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchgpu.checkpoint import files
from torchgpu.checkpoint.layout import SHARDED, SHARDS_DIR, read_meta
from torchgpu.checkpoint.manifest import read_manifest
from torchgpu.errors import CheckpointCorruptError, CheckpointError

MODEL_KEY, OPTIM_KEY = "model", "optim"  # the top-level entries of the DCP state


def is_sharded(directory: Path) -> bool:
    """Whether checkpoint directory ``directory`` has the sharded layout (a ``shards/``
    directory, or meta.json saying so: a checkpoint whose shards were deleted is still
    one, and loading it names what is missing)."""
    return (files.kind_of(directory / SHARDS_DIR) == "dir"
            or read_meta(directory).get("layout") == SHARDED)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """DCP without a process group warns that it assumes one process: intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def distributed() -> bool:
    """Whether a process group is initialised (DCP's calls are then collective)."""
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
    (:func:`~torchgpu.checkpoint.manifest.verify_directory`); this checks the shard
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
        with quiet():
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(source / SHARDS_DIR)),
                     no_dist=not distributed())
        if with_optim:
            assert optimizer is not None
            set_state_dict(model, optimizer, model_state_dict=state[MODEL_KEY],
                           optim_state_dict=state[OPTIM_KEY])
        else:
            set_model_state_dict(model, state[MODEL_KEY])
    except failures() as error:  # DCP wraps each rank's failure: one line of the first
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
        with quiet():
            dcp.load({MODEL_KEY: model},
                     storage_reader=dcp.FileSystemReader(str(source / SHARDS_DIR)), no_dist=True)
    except failures() as error:
        raise CheckpointCorruptError(
            f"the model shards of {files.show(source)} cannot be read ({why(error)}); the "
            "sharded checkpoint is damaged. Use an earlier checkpoint") from None
    return model


def failures() -> tuple[type[BaseException], ...]:
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
