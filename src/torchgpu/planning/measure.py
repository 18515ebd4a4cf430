"""Measure a model's :class:`Footprint` from a small sample batch, on the CPU.

- Model states are exact arithmetic over the parameters: gradients for trainable
  parameters, optimizer state per :data:`OPTIMIZER_STATE_COPIES` (Adam keeps two
  tensors per parameter). Parameters stay in their dtype under mixed precision.
- Activations are measured: one forward of the sample batch (a few rows, so nothing of
  the real batch's size is allocated) with ``saved_tensors_hooks`` counting each
  storage autograd keeps for backward once, attributed to the top-level layer
  (``as_sequential()`` child) that first saved it. Figures scale linearly to the batch.
  With ``precision`` bf16/fp16 the forward runs under CPU autocast.
- With activation checkpointing (ceil(sqrt(n)) segments, all but the last
  checkpointed, as :func:`torchgpu.memory.apply_activation_checkpointing` does) the
  peak keeps the checkpointed segments' inputs plus the larger of the last segment's
  activations and the largest segment being recomputed. A model without layers cannot
  be checkpointed that way: its checkpointed figure equals the plain one.
- The peak's temporaries are taken as twice the largest tensor a layer outputs (the
  gradient flowing back through it and the one it produces).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchgpu.errors import UsageError
from torchgpu.planning.footprint import Footprint, LayerFootprint

#: Optimizer state tensors kept per parameter (each the parameter's size).
OPTIMIZER_STATE_COPIES: dict[str, int] = {
    "adam": 2,
    "adamw": 2,
    "sgd": 0,
    "sgd-momentum": 1,
    "rmsprop": 1,
    "adagrad": 1,
}
_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def layers_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's top-level layers: an ``nn.Sequential``'s children or those of
    ``model.as_sequential()``; empty when the model is neither (not splittable)."""
    if isinstance(model, nn.Sequential):
        return list(model.named_children())
    view = getattr(model, "as_sequential", None)
    if callable(view):
        seq = view()
        if isinstance(seq, nn.Module):
            return list(seq.named_children())
    return []


def _state_bytes(module: nn.Module, optimizer: str) -> tuple[int, int, int]:
    copies = OPTIMIZER_STATE_COPIES[optimizer]
    params = grads = 0
    for p in module.parameters():
        size = p.numel() * p.element_size()
        params += size
        if p.requires_grad:
            grads += size
    return params, grads, copies * grads


def _autocast(precision: str) -> Any:
    dtype = _AUTOCAST.get(precision)
    if dtype is None:
        return torch.autocast("cpu", enabled=False)
    return torch.autocast("cpu", dtype=dtype)


def _saved_by_layer(
    run_layers: Callable[[Callable[[int], None]], None], n_layers: int
) -> tuple[list[int], int]:
    """Bytes first saved while each layer runs (index -1: outside any layer), total."""
    current = [-1]
    per_layer = [0] * max(n_layers, 1)
    outside = [0]
    seen: set[int] = set()
    alive: list[Any] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        base = tensor._base if tensor._base is not None else tensor
        if base.is_leaf and base.requires_grad:  # parameters exist anyway
            return tensor
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in seen:
            return tensor
        seen.add(key)
        alive.append(storage)  # a freed pointer must not be reused and miscounted
        if current[0] >= 0:
            per_layer[current[0]] += storage.nbytes()
        else:
            outside[0] += storage.nbytes()
        return tensor

    def enter(index: int) -> None:
        current[0] = index

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run_layers(enter)
    alive.clear()
    return per_layer, outside[0]


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    return 0


def measure_footprint(
    model: nn.Module,
    sample_batch: torch.Tensor | tuple[torch.Tensor, ...],
    optimizer: str = "adam",
    precision: str = "fp32",
) -> Footprint:
    """The :class:`Footprint` of training ``model`` at ``len(sample_batch)`` samples.

    ``sample_batch`` is the model's input (a tensor, or a tuple of positional inputs)
    with the batch first; keep it small (2 rows): figures scale to any batch. The model
    runs one forward in train mode with autograd recording (no backward, no step) and
    is left as it was: its mode and its buffers (BatchNorm running statistics) are
    restored. Raises UsageError for an unknown optimizer or precision.
    """
    if optimizer not in OPTIMIZER_STATE_COPIES:
        raise UsageError(
            f"optimizer {optimizer!r} is not known to the planner: use one of "
            f"{', '.join(OPTIMIZER_STATE_COPIES)} (the state it keeps decides the memory)"
        )
    if precision not in ("fp32", "bf16", "fp16"):
        raise UsageError(f"precision {precision!r} is not one of fp32, bf16, fp16")
    inputs = sample_batch if isinstance(sample_batch, tuple) else (sample_batch,)
    if not inputs or inputs[0].dim() == 0:
        raise UsageError(
            "the sample batch needs a batch dimension first, e.g. shape (2, 3, 128, 128)"
        )
    batch = int(inputs[0].shape[0])
    layers = layers_of(model)
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    was_training = model.training
    model.train()
    outputs: list[int] = []
    inputs_bytes: list[int] = []

    def run(enter: Callable[[int], None]) -> None:
        with _autocast(precision):
            if not layers:
                enter(0)
                out = model(*inputs)
                outputs.append(_nbytes(out))
                return
            value: Any = inputs[0] if len(inputs) == 1 else inputs
            for index, (_, layer) in enumerate(layers):
                inputs_bytes.append(_nbytes(value))
                enter(index)
                value = layer(value)
                outputs.append(_nbytes(value))
            enter(-1)

    try:
        per_layer, outside = _saved_by_layer(run, len(layers))
    finally:
        model.train(was_training)
        with torch.no_grad():
            for name, value in model.named_buffers():
                if name in buffers:
                    value.copy_(buffers[name])
    params, grads, opt = _state_bytes(model, optimizer)
    activation = sum(per_layer) + outside
    transient = 2 * max(outputs, default=0)
    layer_rows: list[LayerFootprint] = []
    for index, (name, layer) in enumerate(layers):
        p, g, o = _state_bytes(layer, optimizer)
        layer_rows.append(LayerFootprint(name, p, g, o, per_layer[index], inputs_bytes[index]))
    checkpointed = _checkpointed(layer_rows, activation)
    return Footprint(
        batch_size=batch,
        param_bytes=params,
        grad_bytes=grads,
        optimizer_bytes=opt,
        activation_bytes=activation,
        checkpointed_activation_bytes=checkpointed,
        transient_bytes=transient,
        layers=tuple(layer_rows),
        source=f"measured on the CPU with {batch} sample rows, scaled linearly",
    )


def _checkpointed(layers: list[LayerFootprint], activation: int) -> int:
    if len(layers) < 2:
        return activation
    from torchgpu.memory import segment_bounds, sqrt_segments

    bounds = segment_bounds(len(layers), sqrt_segments(len(layers)))
    kept_inputs = sum(layers[start].input_bytes for start, _ in bounds[:-1])
    segment_acts = [sum(layer.activation_bytes for layer in layers[s:e]) for s, e in bounds]
    recomputed = max(segment_acts[:-1], default=0)
    return min(activation, kept_inputs + max(segment_acts[-1], recomputed))


def total_activation_check(model: nn.Module, sample: torch.Tensor) -> int:
    """Saved-for-backward bytes of ``model(sample)`` counted by
    :func:`torchgpu.memory.saved_tensor_bytes` (a cross-check for tests)."""
    from torchgpu.memory import saved_tensor_bytes

    return saved_tensor_bytes(lambda: model(sample))
