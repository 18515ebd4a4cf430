"""Trading compute for memory: activation checkpointing.

:func:`apply_activation_checkpointing` keeps only the inputs of a few segments or
blocks during the forward and recomputes the rest during backward
(``torch.utils.checkpoint`` with ``use_reentrant=False``, RNG state preserved, so
gradients are bitwise those of the plain model, dropout included; where one tensor feeds
several blocks, as T5's position bias does, its gradients are summed in another order,
equal up to float rounding), through
:func:`~torchgpu.memory.recompute.checkpointed`: each piece runs on a copy of its
input (an in-place first layer such as ``ReLU(inplace=True)`` works), a recompute
leaves BatchNorm's running statistics alone, and nothing is recomputed in eval mode.

- A sequential model (``nn.Sequential``, or ``as_sequential()``) is cut into ~√n
  segments: checkpointing every single layer of an MLP saves nothing, because each
  layer's saved input *is* the previous layer's saved output.
- Any other model has its repeated block checkpointed: the module class repeated in
  an ``nn.ModuleList`` / ``nn.Sequential`` that holds the largest share of the
  parameters (a transformer block, a ResNet bottleneck;
  :func:`~torchgpu.memory.repeated_blocks.find_repeated_blocks`).
  ``blocks=`` names the class (or a predicate) instead (a run's
  ``--activation-checkpointing CLASS`` names it: :mod:`~torchgpu.memory.block_names`).
- A key/value cache passed to a block (Hugging Face's ``use_cache``) is turned off
  while it recomputes (:func:`without_cache`): T5 and GPT-2 train as without
  checkpointing.

The model is changed in place and its ``state_dict`` keys stay the same (no wrapper
prefixes), so checkpoints load into the plain model and back. It works under DDP;
checkpoint before wrapping (or pass the wrapped model: it is unwrapped first).
:func:`checkpointing_report` says what a model has checkpointed (for logs).

:func:`~torchgpu.memory.saved_tensors.saved_tensor_bytes` measures the bytes autograd
keeps for backward, so what checkpointing saves can be checked.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

from torchgpu.errors import ConfigError
from torchgpu.memory.recompute import checkpointed, recomputes
from torchgpu.memory.repeated_blocks import (
    NO_FORWARD,
    composite_classes,
    find_repeated_blocks,
    outermost,
    unique_numel,
)
from torchgpu.parallel.data import unwrap

Predicate = Callable[[str, nn.Module], bool]
#: What ``blocks=`` accepts: a module class, a tuple of classes, or a predicate.
BlockSpec = type | tuple[type, ...] | Predicate


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


def is_sequential(model: nn.Module) -> bool:
    """An ``nn.Sequential`` or a model with ``as_sequential()``: checkpointed in segments."""
    return isinstance(model, nn.Sequential) or callable(getattr(model, "as_sequential", None))


def _matching(model: nn.Module, blocks: BlockSpec) -> list[tuple[str, nn.Module]]:
    classes = blocks if isinstance(blocks, tuple) else (blocks,) if isinstance(blocks, type) else ()
    test: Predicate
    if classes and all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        test = lambda _name, module: isinstance(module, classes)  # noqa: E731
    elif callable(blocks) and not isinstance(blocks, type | tuple):
        test = blocks
    else:
        raise ConfigError(
            f"blocks={blocks!r} is not allowed: give an nn.Module subclass, a tuple of "
            "them, or a predicate (name, module) -> bool"
        )
    return outermost([
        (n, m) for n, m in model.named_modules() if test(n, m) and type(m) not in NO_FORWARD
    ])


# ---- wrapping ----------------------------------------------------------------------------
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
        owner: nn.Module = self  # type: ignore[assignment]
        layers = self._torchgpu_layers()
        segments = min(self._torchgpu_ckpt_segments, len(layers))
        bounds = segment_bounds(len(layers), segments) if layers else []
        for index, (start, end) in enumerate(bounds):
            run = _run_layers(layers[start:end])
            # The model's own training flag decides whether to recompute (not in eval).
            last = index == len(bounds) - 1
            input = run(input) if last else checkpointed(owner, run, input)
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
        owner: nn.Module = self  # type: ignore[assignment]
        if recomputes(owner):
            kwargs = without_cache(kwargs)
        return checkpointed(owner, super().forward, *args, **kwargs)  # type: ignore[misc]


#: Keyword arguments through which a block reads and appends to a key/value cache
#: (Hugging Face's names), with the value that turns the cache off.
CACHE_KWARGS: dict[str, object] = {
    "use_cache": False, "cache": None, "past_key_values": None, "past_key_value": None,
    "layer_past": None}


def without_cache(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with any key/value cache turned off (:data:`CACHE_KWARGS`).

    A checkpointed block runs twice, and a cache makes the second run differ from the
    first: the forward appends this step's keys and values to it and marks a decoder's
    cross-attention as cached, so the recomputation attends over the keys twice and
    skips the cross-attention projections (T5: "a different number of tensors was saved
    during the original forward and recomputation"). Training needs no cache, so it is
    dropped, as Hugging Face's own gradient checkpointing does."""
    return {key: (CACHE_KWARGS[key] if key in CACHE_KWARGS and value is not None
                  and value is not False else value) for key, value in kwargs.items()}


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


def _no_block_error(target: nn.Module, segments: object) -> ConfigError:
    name = type(target).__name__
    if segments != "sqrt":
        return ConfigError(
            f"segments={segments!r} needs an nn.Sequential or a model with as_sequential(), "
            f"and {name} is neither: pass blocks=YourBlockClass or a predicate instead, "
            "e.g. segments=lambda name, m: isinstance(m, MyBlock)."
        )
    found = ", ".join(composite_classes(target)) or "none"
    return ConfigError(
        f"{name} is not sequential and has no repeated block (a module class repeated in an "
        "nn.ModuleList or nn.Sequential, holding parameters) to checkpoint: name the class "
        "to recompute, `torchgpu train --activation-checkpointing CLASS`, "
        "fit(..., activation_checkpointing=\"CLASS\") or "
        "apply_activation_checkpointing(model, blocks=CLASS) (or a predicate (name, module) "
        "-> bool); classes in this model with "
        f"layers of their own: {found}."
    )


def _wrap(named: list[tuple[str, nn.Module]]) -> None:
    for _, module in named:
        if isinstance(module, _SegmentCheckpointing):  # a Sequential block, segmented before
            module.__dict__.pop("_torchgpu_ckpt_segments", None)
        _swap_class(module, _ModuleCheckpointing)


def apply_activation_checkpointing(
    model: nn.Module,
    segments: str | int | Predicate = "sqrt",
    *,
    blocks: BlockSpec | None = None,
) -> nn.Module:
    """Checkpoint activations of ``model`` in place and return it.

    ``segments`` (sequential models) and ``blocks`` (any model):

    - default, on an ``nn.Sequential`` or a model with ``as_sequential()``: its layers
      are cut into ceil(√n) contiguous segments (or ``segments=k``); all but the last
      are checkpointed. For an ``as_sequential`` model the forward becomes the run of
      that view, which must compute the same function as the model's own forward.
    - default, on any other model: its repeated block (:func:`find_repeated_blocks`:
      a transformer block, a ResNet bottleneck) has each instance's forward checkpointed.
      Raises ConfigError when it has none, saying what to pass.
    - ``blocks=MyBlock`` (a class or tuple of classes) or a predicate
      ``(name, module) -> bool`` (as ``blocks=`` or as ``segments=``): every matching
      submodule (the outermost, if they nest) has its forward checkpointed; a predicate
      matching nothing warns.

    Parameter names and ``state_dict`` keys are unchanged; wrappers (DDP, DP, compile)
    are looked through. Norm layers' running statistics are updated once per forward,
    as without checkpointing (the recompute leaves them alone); a segment or block
    starting with an in-place layer works (it runs on a copy of its input); in eval
    mode (or under ``no_grad``) nothing is recomputed. What was wrapped:
    :func:`checkpointing_report`. Raises ConfigError for a bad ``segments`` or
    ``blocks`` value.
    """
    target = unwrap(model)
    predicate: BlockSpec | None = blocks
    if callable(segments) and not isinstance(segments, (str, int)):
        if blocks is not None:
            raise ConfigError(
                "give what to checkpoint once: a predicate as segments= or blocks=, not both"
            )
        predicate = segments
    elif blocks is not None and segments != "sqrt":
        raise ConfigError(
            f"segments={segments!r} and blocks={blocks!r} conflict: segments cut a sequential "
            "model, blocks name modules to checkpoint; give one of them"
        )
    if predicate is not None:
        matched = _matching(target, predicate)
        if not matched:
            warnings.warn(
                f"activation checkpointing: blocks={predicate!r} matched no module of "
                f"{type(target).__name__}, so nothing is checkpointed; check the names "
                "and types it tests against model.named_modules().",
                stacklevel=2,
            )
        _wrap(matched)
        return model
    if not is_sequential(target):
        found = find_repeated_blocks(target) if segments == "sqrt" else None
        if found is None:
            raise _no_block_error(target, segments)
        modules = dict(target.named_modules())
        _wrap([(name, modules[name]) for name in found.names])
        return model
    if isinstance(target, nn.Sequential):
        n_layers = len(target)
    else:
        n_layers = len(list(sequential_view(target).children()))
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


def _wrapped(model: nn.Module) -> Iterator[tuple[str, type]]:
    """The checkpointed modules' names and original classes."""
    for name, module in unwrap(model).named_modules():
        if isinstance(module, (_SegmentCheckpointing, _ModuleCheckpointing)):
            yield name, module._torchgpu_ckpt_base


@dataclass(frozen=True)
class CheckpointingReport:
    """What :func:`apply_activation_checkpointing` did to a model.

    ``mode``: ``"segments"`` (a sequential model cut into ``count`` segments),
    ``"blocks"`` (``count`` modules recomputed one by one) or ``"none"``.
    ``class_name``: the blocks' class (for segments, the model's). ``parameter_share``:
    the fraction of the model's parameters recomputed in backward (segments: all but
    the last segment's).
    """

    mode: str
    class_name: str
    count: int
    parameter_share: float
    names: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line for logs."""
        if self.mode == "none":
            return "activation checkpointing: off"
        what = (
            f"{self.class_name} in {self.count} segments (all but the last recomputed)"
            if self.mode == "segments"
            else f"{self.count} x {self.class_name} recomputed in backward"
        )
        return f"activation checkpointing: {what}, {self.parameter_share:.0%} of parameters"


def checkpointing_report(model: nn.Module) -> CheckpointingReport:
    """Which modules of ``model`` are checkpointed (see :class:`CheckpointingReport`)."""
    target = unwrap(model)
    wrapped = list(_wrapped(target))
    total = unique_numel([target])
    if not wrapped:
        return CheckpointingReport("none", "", 0, 0.0)
    if isinstance(target, _SegmentCheckpointing):
        layers = target._torchgpu_layers()
        count = min(target._torchgpu_ckpt_segments, len(layers))
        bounds = segment_bounds(len(layers), count) if layers else [(0, 0)]
        recomputed = layers[: bounds[-1][0]]
        share = unique_numel(recomputed) / total if total else 0.0
        base: type = target._torchgpu_ckpt_base
        return CheckpointingReport("segments", base.__name__, count, share, ("",))
    classes = sorted({base.__name__ for _, base in wrapped})
    modules = dict(target.named_modules())
    share = unique_numel([modules[n] for n, _ in wrapped]) / total if total else 0.0
    return CheckpointingReport(
        "blocks", "/".join(classes), len(wrapped), share, tuple(n for n, _ in wrapped)
    )


def remove_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_activation_checkpointing` in place (all forms) and return ``model``."""
    for module in unwrap(model).modules():
        if isinstance(module, (_SegmentCheckpointing, _ModuleCheckpointing)):
            module.__class__ = module._torchgpu_ckpt_base
            del module._torchgpu_ckpt_base
            module.__dict__.pop("_torchgpu_ckpt_segments", None)
    return model
