"""save_checkpoint / load_checkpoint: the training-state round trip.

See :mod:`torchgpu.checkpoint.layout` for the directory format and
:mod:`torchgpu.checkpoint.atomic` for why a crash never leaves a partial checkpoint.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from torchgpu.checkpoint import atomic
from torchgpu.checkpoint.discover import (
    LATEST,
    find_checkpoint,
    is_checkpoint_dir,
    locate,
    prune,
)
from torchgpu.checkpoint.files import exists, kind_of, list_dir, show
from torchgpu.checkpoint.keys import load_state_dict, normalize
from torchgpu.checkpoint.layout import (
    FORMAT,
    MANIFEST_FILE,
    META_FILE,
    MODEL_FILE,
    STATE_FILE,
    check_weights_only_safe,
    meta_bytes,
    model_bytes,
    read_meta,
    torch_bytes,
)
from torchgpu.checkpoint.manifest import manifest_bytes
from torchgpu.checkpoint.readers import read_pickle
from torchgpu.checkpoint.rng import capture_rng_state, restore_rng_state
from torchgpu.checkpoint.sharded_load import is_sharded, load_sharded_states
from torchgpu.checkpoint.sources import read_file, verify_before_loading
from torchgpu.distributed import RankInfo
from torchgpu.errors import CheckpointError, CheckpointFormatError, CheckpointWriteError

if TYPE_CHECKING:
    from torch.serialization import MAP_LOCATION


class Stateful(Protocol):
    """What ``optimizer=``, ``scheduler=`` and ``scaler=`` must be: an object whose state
    is saved with ``state_dict()`` and restored with ``load_state_dict(state)`` (a torch
    optimizer, LR scheduler or GradScaler)."""

    def state_dict(self) -> Mapping[str, object]: ...

    def load_state_dict(self, state_dict: dict[str, object], /) -> object: ...


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What :func:`load_checkpoint` restored: the resolved directory, the step and epoch
    saved, the ``extra`` dict and the ``meta.json`` contents."""

    path: Path
    step: int
    epoch: int
    extra: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside DataParallel / DDP / FSDP(1) / torch.compile wrappers, nested."""
    try:
        from torchgpu.parallel.data import unwrap
    except ImportError:  # the data-parallel module is optional here; unwrap by hand
        pass
    else:
        return unwrap(model)
    seen = 0
    while seen < 16:
        seen += 1
        inner = getattr(model, "_orig_mod", None)
        if isinstance(inner, nn.Module):
            model = inner
            continue
        name = type(model).__name__
        if name in ("DataParallel", "DistributedDataParallel", "FullyShardedDataParallel"):
            inner = getattr(model, "module", None)
            if isinstance(inner, nn.Module):
                model = inner
                continue
        break
    return model


def canonical_state(model: nn.Module) -> dict[str, object]:
    """The unwrapped model's state dict with ``_orig_mod`` components removed."""
    state = unwrap_model(model).state_dict()
    return {normalize(key): value for key, value in state.items()}


def _distributed(dist: RankInfo | None) -> bool:
    if dist is None or not dist.is_distributed or dist.world_size <= 1:
        return False
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        raise CheckpointError(
            f"save_checkpoint got dist with world_size={dist.world_size} but no process group "
            "is initialised; call init_distributed() first or pass dist=None")
    return True


def _collective_device() -> torch.device:
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree_step(step: int, dist: RankInfo) -> None:
    values = torch.tensor([step, -step], dtype=torch.int64, device=_collective_device())
    torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
    high, low = int(values[0]), -int(values[1])
    if high != low:
        raise CheckpointError(
            f"ranks disagree on the step to save: rank {dist.rank} has step {step}, the ranks "
            f"span {low}..{high}. Every rank must call save_checkpoint at the same step; save "
            "only at agreed step boundaries")


def _rank0_outcome(error: BaseException | None, dist: RankInfo) -> None:
    """Broadcast rank 0's success or failure; doubles as the barrier after the write."""
    box: list[str | None] = [None if error is None else f"{type(error).__name__}: {error}"]
    torch.distributed.broadcast_object_list(box, src=0)
    if error is None and box[0] is not None:
        raise CheckpointWriteError(f"rank 0 failed to write the checkpoint ({box[0]}); rank "
                              f"{dist.rank} stops too. Fix the cause on rank 0 and save again")


def save_checkpoint(
    path: str | Path, *, model: nn.Module, optimizer: Stateful | None = None,
    scheduler: Stateful | None = None, scaler: Stateful | None = None, step: int = 0,
    epoch: int = 0, extra: Mapping[str, object] | None = None,
    meta: Mapping[str, object] | None = None, keep_last: int | None = None,
    dist: RankInfo | None = None,
) -> Path:
    """Save a complete training state as checkpoint directory ``path``, atomically.

    Writes model.safetensors, state.pt, meta.json and manifest.json into a temporary
    sibling, fsyncs, renames it into place, then points ``path.parent/latest`` at it and
    (with ``keep_last``) deletes older checkpoints. RNG states are captured
    automatically. Under DDP (``dist`` distributed) every rank must call this at the
    same step (checked; :class:`CheckpointError` otherwise); rank 0 writes and the others
    return once it has committed. Returns ``path``.
    """
    final = Path(path)
    distributed = _distributed(dist)
    if distributed:
        assert dist is not None
        _agree_step(step, dist)
        if dist.rank != 0:
            _rank0_outcome(None, dist)
            return final
    try:
        _write(final, model, optimizer, scheduler, scaler, step, epoch, extra, meta, keep_last,
               dist.world_size if dist is not None else 1)
    except BaseException as error:
        if distributed:
            assert dist is not None
            _rank0_outcome(error, dist)
        raise
    if distributed:
        assert dist is not None
        _rank0_outcome(None, dist)
    return final


def _write(final: Path, model: nn.Module, optimizer: Stateful | None,
           scheduler: Stateful | None, scaler: Stateful | None, step: int, epoch: int,
           extra: Mapping[str, object] | None, meta: Mapping[str, object] | None,
           keep_last: int | None, world_size: int) -> None:
    _check_destination(final)
    model_data, model_extra = model_bytes(canonical_state(model))
    state = {
        "format": FORMAT, "step": int(step), "epoch": int(epoch),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "rng": capture_rng_state(), "extra": dict(extra or {}), "model_extra": model_extra,
    }
    for key in ("optimizer", "scheduler", "scaler", "extra", "model_extra"):
        check_weights_only_safe(state[key], key)
    files: dict[str, bytes | bytearray | memoryview] = {
        MODEL_FILE: model_data,
        STATE_FILE: torch_bytes(state),
        META_FILE: meta_bytes(meta, step=int(step), epoch=int(epoch), world_size=world_size),
    }
    files[MANIFEST_FILE] = manifest_bytes(files)
    atomic.clean_orphans(final.parent)
    replacing = exists(final)
    atomic.commit_directory(final, files)
    try:
        atomic.write_pointer(final.parent, final.name, LATEST)
    except (CheckpointError, OSError) as error:
        raise _pointer_failed(final, replacing, error) from None
    if keep_last is not None:
        prune(final.parent, keep_last, protect=final)


def _check_destination(final: Path) -> None:
    """Refuse, before anything is written, a checkpoint path ``latest`` could not name
    (see :func:`~torchgpu.checkpoint.atomic.name_problem`) and an existing path that is
    not a torchgpu checkpoint directory: saving replaces what is there, and a user's
    file or directory (``OUT/checkpoints`` itself, say ``save_checkpoint("run/.")``) must
    never be replaced and deleted."""
    name = final.name if str(final) not in ("", ".") else ""
    problem = atomic.name_problem(name)
    if problem is None and (atomic.is_temporary(name) or name == LATEST):
        problem = "it is a name torchgpu reserves for its own files"
    if problem is None and len(f".{name}.old-{atomic.token()}".encode()) > 255:
        problem = "it leaves no room for the temporary name saving needs (keep it under ~200 bytes)"
    if problem is not None:
        raise CheckpointError(
            f"cannot save a checkpoint as {show(final)}: {problem}. Name checkpoint "
            "directories like 'step-00000100' inside the directory that holds them")
    kind = kind_of(final)
    if kind == "missing" or (kind == "dir" and is_checkpoint_dir(final)):
        return
    if kind == "dir" and not list_dir(final):
        return
    what = "a file" if kind == "file" else "not a directory" if kind == "other" else (
        "a directory that is not a torchgpu checkpoint (no manifest.json, state.pt or "
        "meta.json in it)")
    raise CheckpointError(
        f"cannot save a checkpoint as {show(final)}: it exists and is {what}, and saving "
        "would replace it. Nothing was written; save to a new checkpoint path inside it "
        f"(e.g. {show(final / 'step-00000100')}) or move it away first")


def _pointer_failed(final: Path, replaced: bool, error: BaseException) -> CheckpointError:
    """The error for a commit whose ``latest`` could not be updated. A new checkpoint is
    removed again, so that ``latest`` and the directory agree (nothing was committed); a
    replaced one cannot be un-replaced and is said to be there."""
    if not replaced:
        shutil.rmtree(final, ignore_errors=True)
        return CheckpointError(
            f"{error}. The new checkpoint {show(final)} was removed again, so nothing was "
            "committed and any earlier checkpoint is untouched; free space or fix the "
            "directory and save again")
    return CheckpointError(
        f"{error}. {show(final)} itself was rewritten; fix the directory and save again")


# Optimizer states that hold one value per element of their parameter (Adam's moments,
# SGD's momentum, RMSprop's average...): each must have its parameter's shape. Others
# (a step count, Adafactor's factored rows and columns, L-BFGS's flat history) need not.
_ELEMENTWISE_STATES = frozenset({
    "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "exp_inf", "momentum_buffer", "square_avg",
    "grad_avg", "acc_delta", "sum", "ax", "prev", "step_size"})


def _check_optimizer_shapes(optimizer: torch.optim.Optimizer, found: Path) -> None:
    """Refuse optimizer state that ``load_state_dict`` took but the first step would fail
    on: a per-element state whose shape is not its parameter's (torch checks only the
    parameter counts)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, param in enumerate(params):
        for key, value in optimizer.state.get(param, {}).items():
            if (key in _ELEMENTWISE_STATES and isinstance(value, torch.Tensor)
                    and value.shape != param.shape):
                raise CheckpointFormatError(
                    f"the optimizer state in {found} does not fit the optimizer given: its "
                    f"{key!r} of parameter {index} has shape {list(value.shape)}, expected "
                    f"{list(param.shape)} (that parameter's shape). The checkpoint was "
                    "written for another model, or changed after it was saved: resume from "
                    "another checkpoint, or build the model and optimizer as the run that "
                    "saved it did")


def load_checkpoint(
    path: str | Path, *, model: nn.Module | None = None, optimizer: Stateful | None = None,
    scheduler: Stateful | None = None, scaler: Stateful | None = None,
    map_location: MAP_LOCATION = "cpu", strict: bool = True,
    trust: bool = False, restore_rng: bool = True, verify: bool = True,
) -> LoadedCheckpoint:
    """Restore what :func:`save_checkpoint` saved into the objects given.

    ``path`` is a checkpoint directory, a directory holding them or a ``torchgpu train``
    run directory (``latest`` is followed, falling back with a warning to the newest
    complete one; see :func:`~torchgpu.checkpoint.discover.locate`). The manifest is
    verified first (:class:`CheckpointCorruptError` naming a bad file or a missing or
    malformed manifest; ``verify=False`` skips that for files you trust); files are read
    weights-only onto ``map_location`` (so a checkpoint saved on ``cuda:3`` loads on a
    CPU-only machine). Model weights go through :func:`load_state_dict`, so any wrapper
    fits any wrapper. Asking for a state the checkpoint lacks (e.g. ``optimizer=`` when
    none was saved) raises :class:`CheckpointError` under ``strict``. A plain weights
    file (``.pt``, ``.safetensors``...) loads into ``model`` only, with step 0.
    """
    source = Path(path)
    if locate(source).kind == "file":
        if any(x is not None for x in (optimizer, scheduler, scaler)):
            raise CheckpointError(
                f"{show(source)} is a weights file with no optimizer/scheduler/scaler state; "
                "load it with model= only (or load_state_dict), or pass a torchgpu checkpoint "
                "directory")
        if model is not None:
            load_state_dict(model, read_file(source, trust=trust, map_location=map_location),
                            strict=strict)
        return LoadedCheckpoint(path=source, step=0, epoch=0)
    found = find_checkpoint(source)
    if found is None:
        raise CheckpointError(
            f"no complete checkpoint at {show(source)} (no manifest.json there, no 'latest' "
            "file, no complete checkpoint directory inside); check the path or start without "
            "resuming")
    if verify:
        verify_before_loading(found)
    state = read_pickle(found / STATE_FILE, map_location=map_location, trust=trust)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{found / STATE_FILE} is not a torchgpu training state; "
                              "it may come from another tool. Load weights with load_state_dict")
    sharded = is_sharded(found)
    if sharded and (model is not None or optimizer is not None):
        if model is None:
            raise CheckpointError(f"{found} is a sharded checkpoint: its optimizer state "
                                  "loads together with its model; pass model= too")
        load_sharded_states(found, model, optimizer if isinstance(
            optimizer, torch.optim.Optimizer) else None)
        optimizer = None  # restored with the model
    if model is not None and not sharded:
        weights = read_file(found / MODEL_FILE, map_location=map_location)
        if isinstance(state.get("model_extra"), dict):
            weights.update(state["model_extra"])
        load_state_dict(model, weights, strict=strict)
    for name, target in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)):
        if target is None:
            continue
        saved = state.get(name)
        if saved is None:
            message = (f"{found} holds no {name} state but {name}= was given; the run that "
                       f"saved it had no {name}")
            if strict:
                raise CheckpointError(message + "; pass strict=False to start it fresh")
            warnings.warn(message + "; it keeps its fresh state", UserWarning, stacklevel=2)
            continue
        try:
            target.load_state_dict(saved)
        except (ValueError, KeyError, RuntimeError) as error:
            raise CheckpointError(
                f"the {name} state in {found} does not fit the {name} given ({error}); build "
                f"the {name} the same way as the run that saved it") from None
        if isinstance(target, torch.optim.Optimizer):
            _check_optimizer_shapes(target, found)
    if restore_rng and state.get("rng") is not None:
        restore_rng_state(state["rng"])
    step, epoch, extra = state.get("step", 0), state.get("epoch", 0), state.get("extra") or {}
    if not (isinstance(step, int) and isinstance(epoch, int) and isinstance(extra, dict)):
        raise CheckpointFormatError(
            f"{found / STATE_FILE} holds a step, epoch or extra of the wrong type (step "
            f"{type(step).__name__}, epoch {type(epoch).__name__}, extra "
            f"{type(extra).__name__}); it was not written by save_checkpoint. Use another "
            "checkpoint")
    return LoadedCheckpoint(path=found, step=step, epoch=epoch, extra=dict(extra),
                            meta=read_meta(found))
