"""Trading compute for memory: activation checkpointing, and measuring what it saves.

:func:`apply_activation_checkpointing` keeps only the inputs of a few segments during
the forward and recomputes the rest during backward (``torch.utils.checkpoint`` with
``use_reentrant=False``, RNG state preserved, so gradients are bitwise those of the
plain model, dropout included). On a sequential model it cuts the layers into ~√n
segments: checkpointing every single layer of an MLP saves nothing, because each
layer's saved input *is* the previous layer's saved output.

The model is changed in place and its ``state_dict`` keys stay the same (no wrapper
prefixes), so checkpoints load into the plain model and back. It works under DDP;
checkpoint before wrapping (or pass the wrapped model: it is unwrapped first).

:func:`saved_tensor_bytes` measures the bytes autograd keeps for backward.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from torchgpu.errors import ConfigError
from torchgpu.parallel.data import unwrap

Predicate = Callable[[str, nn.Module], bool]


def _checkpointed(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def segment_bounds(n_layers: int, n_segments: int) -> list[tuple[int, int]]:
    """``n_layers`` split into ``n_segments`` contiguous ``[start, end)`` ranges whose
    sizes differ by at most one (larger ones first)."""
    if not 1 <= n_segments <= max(n_layers, 1):
        raise ConfigError(
            f"cannot cut {n_layers} layers into {n_segments} segments: use 1..{n_layers}."
        )
    base, extra = divmod(n_layers, n_segments)
    bounds, start = [], 0
    for index in range(n_segments):
        end = start + base + (1 if index < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def sqrt_segments(n_layers: int) -> int:
    """The default segment count, ceil(√n): saved memory grows like √n, not n."""
    return max(1, math.ceil(math.sqrt(n_layers)))


def sequential_view(model: object) -> nn.Module:
    """``model.as_sequential()``: the model as an ordered run of child modules."""
    view: Callable[[], nn.Module] = getattr(model, "as_sequential")  # noqa: B009
    return view()


class _SegmentCheckpointing:
    """Mixin placed before a sequential model's class: its forward runs the layers in
    segments, all but the last under checkpoint. The last runs plainly: its activations
    are needed as soon as backward starts, so recomputing them saves nothing at the peak.
    """

    _torchgpu_ckpt_segments: int
    _torchgpu_ckpt_base: type

    def _torchgpu_layers(self) -> list[nn.Module]:
        if isinstance(self, nn.Sequential):
            return list(self._modules.values())
        return list(sequential_view(self).children())

    def forward(self, input: Any) -> Any:
        layers = self._torchgpu_layers()
        segments = min(self._torchgpu_ckpt_segments, len(layers))
        bounds = segment_bounds(len(layers), segments) if layers else []
        for index, (start, end) in enumerate(bounds):
            run = _run_layers(layers[start:end])
            input = run(input) if index == len(bounds) - 1 else _checkpointed(run, input)
        return input


def _run_layers(layers: list[nn.Module]) -> Callable[[Any], Any]:
    def run(value: Any) -> Any:
        for layer in layers:
            value = layer(value)
        return value

    return run


class _ModuleCheckpointing:
    """Mixin placed before a module's class: its whole forward runs under checkpoint.
    Hooks registered on the module still run outside the checkpoint."""

    _torchgpu_ckpt_base: type

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _checkpointed(super().forward, *args, **kwargs)  # type: ignore[misc]


class CheckpointedSequential(_SegmentCheckpointing, nn.Sequential):
    """What a plain ``nn.Sequential`` becomes (a named class, so the model still pickles)."""


_CLASS_CACHE: dict[tuple[type, type], type] = {(_SegmentCheckpointing, nn.Sequential): (
    CheckpointedSequential
)}


def _swap_class(module: nn.Module, mixin: type) -> None:
    """Give ``module`` a subclass of its class with ``mixin``'s forward (as FSDP2 does):
    parameters, buffers, hooks and state_dict keys are untouched."""
    base = type(module)
    if issubclass(base, (_SegmentCheckpointing, _ModuleCheckpointing)):
        base = module._torchgpu_ckpt_base  # type: ignore[assignment]
    cls = _CLASS_CACHE.get((mixin, base))
    if cls is None:
        cls = type(f"Checkpointed{base.__name__}", (mixin, base), {})
        _CLASS_CACHE[(mixin, base)] = cls
    module.__class__ = cls
    module._torchgpu_ckpt_base = base  # type: ignore[assignment]


def apply_activation_checkpointing(
    model: nn.Module, segments: str | int | Predicate = "sqrt"
) -> nn.Module:
    """Checkpoint activations of ``model`` in place and return it.

    ``segments``:

    - ``"sqrt"`` (default) or an int k: the model's layers (an ``nn.Sequential``'s
      children, or the children of ``model.as_sequential()``) are cut into ceil(√n) or k
      contiguous segments; all but the last are checkpointed. For an ``as_sequential``
      model the forward becomes the run of that view, which must compute the same
      function as the model's own forward.
    - a predicate ``(name, module) -> bool``: every submodule (named as in
      ``named_modules()``) for which it is True has its forward checkpointed, e.g.
      ``lambda name, m: isinstance(m, Bottleneck)``.

    Parameter names and ``state_dict`` keys are unchanged; wrappers (DDP, DP, compile)
    are looked through. Batch-norm running statistics are updated again during the
    recompute, as with any activation checkpointing. Raises ConfigError for a bad
    ``segments`` value or a non-sequential model without a predicate.
    """
    target = unwrap(model)
    if callable(segments) and not isinstance(segments, (str, int)):
        matched = [m for name, m in target.named_modules() if segments(name, m)]
        if not matched:
            warnings.warn(
                f"activation checkpointing: the predicate matched no module of "
                f"{type(target).__name__}, so nothing is checkpointed; check the names "
                "and types it tests against model.named_modules().",
                stacklevel=2,
            )
        for module in matched:
            _swap_class(module, _ModuleCheckpointing)
        return model
    if isinstance(target, nn.Sequential):
        n_layers = len(target)
    elif callable(getattr(target, "as_sequential", None)):
        n_layers = len(list(sequential_view(target).children()))
    else:
        raise ConfigError(
            f"segments={segments!r} needs an nn.Sequential or a model with as_sequential(), "
            f"and {type(target).__name__} is neither: pass a predicate instead, e.g. "
            "segments=lambda name, m: isinstance(m, MyBlock)."
        )
    if segments == "sqrt":
        count = sqrt_segments(n_layers)
    elif isinstance(segments, int) and not isinstance(segments, bool) and segments >= 1:
        count = min(segments, n_layers)
    else:
        raise ConfigError(
            f"segments={segments!r} is not valid: use 'sqrt', an integer >= 1, or a "
            "predicate (name, module) -> bool."
        )
    _swap_class(target, _SegmentCheckpointing)
    target._torchgpu_ckpt_segments = count  # type: ignore[assignment]
    return model


def remove_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_activation_checkpointing` in place (all forms) and return ``model``."""
    for module in unwrap(model).modules():
        if isinstance(module, (_SegmentCheckpointing, _ModuleCheckpointing)):
            module.__class__ = module._torchgpu_ckpt_base
            del module._torchgpu_ckpt_base
            module.__dict__.pop("_torchgpu_ckpt_segments", None)
    return model


def saved_tensor_bytes(fn: Callable[[], Any]) -> int:
    """Bytes autograd saves for backward while ``fn()`` runs (run the forward only).

    Counted through ``torch.autograd.graph.saved_tensors_hooks``: each saved tensor's
    whole storage, each unique storage once (a ReLU's saved output that is also the
    next Linear's saved input counts once). Not counted: leaf tensors that require grad
    (parameters, and views of them such as a Linear's transposed weight), whose memory
    exists whether or not autograd keeps them. Under activation checkpointing the
    tensors saved inside a checkpointed segment are not kept (they are recomputed), but
    each segment's inputs are, and are counted.
    """
    sizes: dict[tuple[str, int], int] = {}
    alive: list[Any] = []  # keep storages alive so a freed pointer is not reused and miscounted

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        base = tensor._base if tensor._base is not None else tensor
        if base.is_leaf and base.requires_grad:
            return tensor
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        key = (str(tensor.device), pointer if pointer else id(storage))
        sizes[key] = storage.nbytes()
        alive.append(storage)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    alive.clear()
    return sum(sizes.values())


# Out-of-memory back-off (shrinking the micro-batch on OOM) belongs in this module too;
# it is kept apart from the checkpointing code above.
