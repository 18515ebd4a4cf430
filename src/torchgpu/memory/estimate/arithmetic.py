"""Exact memory arithmetic: parameters, gradients, optimizer state, checkpointed segments.

Pure functions on numbers, so the rules are tested by tables (tests/unit/test_estimate.py).
Sizes are bytes. ``block_bytes`` models the CUDA caching allocator, which rounds every
allocation up to a multiple of 512 bytes; pass 1 for exact tensor sizes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from torchgpu.errors import ConfigError

CUDA_BLOCK_BYTES = 512


@dataclass(frozen=True)
class OptimizerRule:
    """``states``: param-sized state tensors per parameter (same dtype as the parameter);
    ``workspace``: param-sized temporaries the foreach ``step`` allocates at once.

    Scalar state such as Adam's ``step`` is a CPU tensor (unless fused or capturable) and
    takes no device memory, so it is not counted.
    """

    states: int
    workspace: int


OPTIMIZERS: dict[str, OptimizerRule] = {
    "none": OptimizerRule(0, 0),
    "sgd": OptimizerRule(0, 0),
    "sgd_momentum": OptimizerRule(1, 0),  # momentum_buffer
    "adam": OptimizerRule(2, 1),  # exp_avg, exp_avg_sq; sqrt(exp_avg_sq) temporary
    "adamw": OptimizerRule(2, 1),
    "adam_amsgrad": OptimizerRule(3, 1),  # + max_exp_avg_sq
    "adamax": OptimizerRule(2, 1),  # exp_avg, exp_inf
    "nadam": OptimizerRule(2, 1),
    "radam": OptimizerRule(2, 1),
    "adagrad": OptimizerRule(1, 1),  # sum; sqrt(sum) temporary
    "rmsprop": OptimizerRule(1, 1),  # square_avg
    "rmsprop_momentum": OptimizerRule(2, 1),  # + momentum_buffer
    "rmsprop_centered": OptimizerRule(2, 1),  # + grad_avg
    "adadelta": OptimizerRule(2, 2),  # square_avg, acc_delta
}


def optimizer_kind(optimizer: str | torch.optim.Optimizer | type) -> str:
    """The :data:`OPTIMIZERS` key for a name, an optimizer class, or an optimizer instance.

    An instance is read for its options (SGD momentum, Adam amsgrad, RMSprop momentum and
    centered). Raises :class:`ConfigError` for an unknown optimizer.
    """
    if isinstance(optimizer, str):
        key = optimizer.lower().replace("-", "_")
        if key not in OPTIMIZERS:
            raise ConfigError(
                f"unknown optimizer {optimizer!r}: the estimate knows "
                f"{', '.join(OPTIMIZERS)}; pick the one whose state matches yours"
            )
        return key
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    name = cls.__name__.lower()
    group: Mapping[str, object] = (
        optimizer.param_groups[0] if isinstance(optimizer, torch.optim.Optimizer) else {}
    )
    if name == "sgd":
        return "sgd_momentum" if group.get("momentum", 0) else "sgd"
    if name in ("adam", "adamw") and group.get("amsgrad", False):
        return "adam_amsgrad"
    if name == "rmsprop":
        if group.get("centered", False):
            return "rmsprop_centered"
        return "rmsprop_momentum" if group.get("momentum", 0) else "rmsprop"
    return optimizer_kind(name)


def round_up(nbytes: int, block_bytes: int = CUDA_BLOCK_BYTES) -> int:
    """``nbytes`` rounded up to a multiple of ``block_bytes`` (0 stays 0)."""
    if block_bytes < 1:
        raise ConfigError(f"block_bytes={block_bytes} is not allowed: use 1 or more")
    return -(-nbytes // block_bytes) * block_bytes


@dataclass(frozen=True)
class StateBytes:
    """Device bytes of a set of parameters and what training keeps for them."""

    parameters_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    step_workspace_bytes: int


def state_bytes(
    tensors: Iterable[tuple[int, int, bool]],
    optimizer: str,
    block_bytes: int = CUDA_BLOCK_BYTES,
    shards: int = 1,
) -> StateBytes:
    """Parameters, gradients and optimizer state for ``(numel, itemsize, trainable)`` tensors.

    Gradients and optimizer state exist for trainable tensors only, in the tensor's dtype
    (mixed precision keeps fp32 master weights, so an fp32 model under bf16 autocast
    still has fp32 gradients and Adam moments). ``shards`` > 1 is FSDP full sharding:
    every tensor is flattened, padded to a multiple of ``shards`` elements and split.
    """
    rule = OPTIMIZERS[optimizer_kind(optimizer)]
    params = grads = 0
    for numel, itemsize, trainable in tensors:
        local = -(-numel // shards) if shards > 1 else numel
        size = round_up(local * itemsize, block_bytes)
        params += size
        if trainable:
            grads += size
    return StateBytes(
        parameters_bytes=params,
        gradients_bytes=grads,
        optimizer_bytes=rule.states * grads,
        step_workspace_bytes=rule.workspace * grads,
    )


def module_tensors(module: nn.Module) -> list[tuple[int, int, bool]]:
    """``(numel, itemsize, trainable)`` of each distinct parameter and buffer of ``module``."""
    seen: set[int] = set()
    out: list[tuple[int, int, bool]] = []
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append((p.numel(), p.element_size(), p.requires_grad))
    for b in module.buffers():
        if id(b) not in seen:
            seen.add(id(b))
            out.append((b.numel(), b.element_size(), False))
    return out


def union_bytes(sizes: Mapping[int, int], *key_sets: Iterable[int]) -> int:
    """Bytes of the union of storage keys (each storage counted once)."""
    keys: set[int] = set()
    for ks in key_sets:
        keys.update(ks)
    return sum(sizes[k] for k in keys)


def retained_bytes(
    sizes: Mapping[int, int],
    layer_saved: Sequence[frozenset[int]],
    layer_inputs: Sequence[frozenset[int]],
    bounds: Sequence[tuple[int, int]],
) -> int:
    """Saved bytes alive at the end of the forward when the layers run in ``bounds``
    segments, all but the last checkpointed: each checkpointed segment's input plus
    everything the last segment saves (see :func:`checkpointed_bytes`)."""
    if not bounds:
        return 0
    inputs = [layer_inputs[start] for start, _ in bounds[:-1]]
    last_start, last_end = bounds[-1]
    return union_bytes(sizes, *inputs, *layer_saved[last_start:last_end])


def checkpointed_bytes(
    sizes: Mapping[int, int],
    layer_saved: Sequence[frozenset[int]],
    layer_inputs: Sequence[frozenset[int]],
    bounds: Sequence[tuple[int, int]],
) -> int:
    """Peak saved bytes when the layers run in ``bounds`` segments, all but the last
    checkpointed (recomputed in backward), as ``apply_activation_checkpointing`` does.

    ``sizes`` maps storage keys to bytes; ``layer_saved[i]`` are the storages layer ``i``
    saves for backward, ``layer_inputs[i]`` its input storages. At the end of the forward
    :func:`retained_bytes` are alive. While backward recomputes segment j, the inputs of
    segments 0..j and segment j's saved tensors are alive. The result is the larger.
    """
    peak = retained_bytes(sizes, layer_saved, layer_inputs, bounds)
    inputs = [layer_inputs[start] for start, _ in bounds[:-1]]
    for j, (start, end) in enumerate(bounds[:-1]):
        internals = layer_saved[start:end]
        peak = max(peak, union_bytes(sizes, *inputs[: j + 1], *internals))
    return peak


def block_checkpointed_bytes(
    sizes: Mapping[int, int],
    saved: Iterable[int],
    block_saved: Sequence[frozenset[int]],
    block_inputs: Sequence[frozenset[int]],
) -> int:
    """Peak saved bytes when every repeated block is checkpointed on its own (as
    ``apply_activation_checkpointing`` does to a model that is not sequential).

    Kept through the forward: what is saved outside the blocks, plus every block's
    inputs. While backward recomputes block j, block j's saved tensors join them. The
    result is the largest of these (each storage counted once).
    """
    inside: set[int] = set()
    for keys in block_saved:
        inside.update(keys)
    retained = {k for k in saved if k not in inside}
    for keys in block_inputs:
        retained.update(keys)
    return max([union_bytes(sizes, retained)]
               + [union_bytes(sizes, retained, keys) for keys in block_saved])


def training_peak_bytes(
    *,
    parameters_bytes: int,
    gradients_bytes: int,
    optimizer_bytes: int,
    activations_bytes: int,
    backward_workspace_bytes: int,
    step_workspace_bytes: int,
    extra_bytes: int = 0,
) -> int:
    """The high-water mark of one training step (steady state, after the first step).

    Backward: weights, optimizer state, the saved activations, gradients and the
    workspace of the largest backward op (conservative: at the true peak, early in
    backward, few gradients exist yet). Optimizer step: weights, gradients, state and
    the foreach temporaries. ``extra_bytes`` (DDP buckets, FSDP gathered weights) is
    alive in both.
    """
    backward = (
        parameters_bytes
        + optimizer_bytes
        + activations_bytes
        + gradients_bytes
        + backward_workspace_bytes
    )
    step = parameters_bytes + gradients_bytes + optimizer_bytes + step_workspace_bytes
    return max(backward, step) + extra_bytes
