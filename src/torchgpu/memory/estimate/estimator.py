"""estimate_memory: per-device training memory for a model, batch and strategy.

Parameters, gradients and optimizer state are exact arithmetic
(:mod:`torchgpu.memory.estimate.arithmetic`); activations are measured on fake tensors
(:mod:`torchgpu.memory.estimate.activations`); nothing is allocated at the model's size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from torchgpu.errors import ConfigError
from torchgpu.memory.estimate.activations import (
    ActivationProfile,
    as_call,
    measure_activations,
    sequential_layers,
)
from torchgpu.memory.estimate.arithmetic import (
    CUDA_BLOCK_BYTES,
    StateBytes,
    block_checkpointed_bytes,
    checkpointed_bytes,
    module_tensors,
    optimizer_kind,
    state_bytes,
    training_peak_bytes,
    union_bytes,
)
from torchgpu.memory.estimate.result import DeviceMemory, MemoryEstimate
from torchgpu.parallel.data import shard_units

STRATEGIES = ("single", "ddp", "fsdp", "split", "pipeline")
def _device_names(n: int, devices: Sequence[str] | None) -> list[str]:
    if devices is None:
        return [f"cuda:{i}" for i in range(n)]
    return [str(d) for d in devices]


def _ckpt_bounds(n_layers: int) -> list[tuple[int, int]]:
    # The same cut as apply_activation_checkpointing(segments="sqrt").
    from torchgpu.memory.activation_checkpointing import segment_bounds, sqrt_segments

    return segment_bounds(n_layers, sqrt_segments(n_layers)) if n_layers else []


def _stage_activations(
    profile: ActivationProfile, start: int, end: int, checkpointing: bool, block_bytes: int
) -> int:
    sizes = profile.rounded(block_bytes)
    saved = profile.layer_saved[start:end]
    if not checkpointing:
        return union_bytes(sizes, *saved)
    bounds = [(a + start, b + start) for a, b in _ckpt_bounds(end - start)]
    return checkpointed_bytes(sizes, profile.layer_saved, profile.layer_inputs, bounds)


def _device(
    name: str,
    state: StateBytes,
    activations: int,
    workspace: int,
    extra: int,
    layers: tuple[int, int] | None = None,
) -> DeviceMemory:
    peak = training_peak_bytes(
        parameters_bytes=state.parameters_bytes,
        gradients_bytes=state.gradients_bytes,
        optimizer_bytes=state.optimizer_bytes,
        activations_bytes=activations,
        backward_workspace_bytes=workspace,
        step_workspace_bytes=state.step_workspace_bytes,
        extra_bytes=extra,
    )
    total = (
        state.parameters_bytes + state.gradients_bytes + state.optimizer_bytes + activations + extra
    )
    return DeviceMemory(
        device=name,
        parameters_bytes=state.parameters_bytes,
        gradients_bytes=state.gradients_bytes,
        optimizer_bytes=state.optimizer_bytes,
        activations_bytes=activations,
        extra_bytes=extra,
        peak_bytes=peak,
        total_bytes=total,
        layers=layers,
    )


def _sample_kind(sample_batch: Any) -> str:
    if isinstance(sample_batch, Mapping):
        return f"a dict ({', '.join(map(str, sample_batch))})"
    return f"a {type(sample_batch).__name__} of {len(sample_batch)} inputs"


def _sample_slice(sample: Any, rows: int) -> Any:
    """``sample`` with ``rows`` rows in every batched tensor (meta: shapes only)."""
    from torchgpu.memory.estimate.activations import map_tensors

    def meta(t: torch.Tensor) -> torch.Tensor:
        shape = (rows, *t.shape[1:]) if t.dim() else ()
        return torch.empty(shape, dtype=t.dtype, device="meta")

    return map_tensors(sample, meta)


def _resolve_balance(
    balance: Sequence[int] | str | None,
    n_layers: int,
    stages: int,
    layer_costs: Callable[[], list[float]],
) -> list[int]:
    from torchgpu.parallel.balance import even_balance, solve_partition, validate_balance

    if balance is None:
        return even_balance(n_layers, stages)
    if balance == "memory":
        return solve_partition(layer_costs(), stages)
    if isinstance(balance, str):
        raise ConfigError(
            f"balance={balance!r} is not allowed: use None (even), 'memory', or a list of "
            "layer counts per stage"
        )
    return validate_balance(list(balance), n_layers, stages)


def estimate_memory(
    model: nn.Module,
    sample_batch: Any,
    optimizer: str | torch.optim.Optimizer | type = "adam",
    precision: str = "fp32",
    strategy: str = "single",
    world_size: int = 1,
    devices: Sequence[str] | None = None,
    balance: Sequence[int] | str | None = None,
    chunks: int = 1,
    activation_checkpointing: bool = False,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    block_bytes: int = CUDA_BLOCK_BYTES,
    profile: ActivationProfile | None = None,
) -> MemoryEstimate:
    """Estimate the memory of training ``model`` on ``sample_batch``, per device.

    - ``sample_batch``: the model's input for one step on one device (per rank for
      ddp/fsdp; the whole batch for split/pipeline), of any structure: a tensor
      (``model(x)``), a tuple/list (``model(*inputs)``), a dict (``model(**batch)``,
      e.g. ``{"input_ids": ..., "labels": ...}``), nested; integer tensors stay
      integers. Only shapes and dtypes are read, so ``torch.empty(..., device="meta")``
      tensors are enough. A loss the model computes (``output.loss``) is measured
      with the forward; ``loss_fn(output)`` adds one computed from the output.
    - ``optimizer``: a name in :data:`~torchgpu.memory.estimate.arithmetic.OPTIMIZERS`
      ("adam", "adamw", "sgd", "sgd_momentum", ...), an optimizer class or instance.
    - ``precision``: "fp32", or "bf16"/"fp16" autocast (fp32 master weights, gradients
      and optimizer state; activations measured under autocast).
    - ``strategy``: "single"; "ddp" (a full replica per rank plus gradient buckets);
      "fsdp" (parameters, gradients, optimizer state sharded over ranks, plus two
      gathered units); "split" (the sequential layers over stages); "pipeline" (split,
      with the batch in ``chunks`` micro-batches, fill-drain schedule).
    - ``world_size`` / ``devices``: ranks or stages (``devices`` names them; default
      ``cuda:0..``). ``balance``: layer counts per stage, None for even counts (as
      ``split_model``), or "memory" to minimise the largest stage.
    - ``activation_checkpointing``: as ``apply_activation_checkpointing`` does it: the
      sequential layers cut into ceil(√n) segments, all but the last recomputed in
      backward; a model that is not sequential has each repeated block recomputed;
      for a pipeline, each micro-batch but the last keeps only its stage input (as
      ``Pipeline(checkpoint="except_last")``).
    - ``block_bytes``: allocation rounding (512 on CUDA; 1 for exact tensor bytes).
    - ``profile``: a :func:`measure_activations` result to reuse (same model and
      precision; used when its batch size is the one needed).

    Parameters are counted once each, so tied weights (an LM head sharing the token
    embedding) count once. Split and pipeline need the model as layers: an
    ``nn.Sequential`` or a model with ``as_sequential()``; checkpointing needs that or a
    repeated block. Raises :class:`ConfigError` (or BalanceError).
    """
    if strategy not in STRATEGIES:
        raise ConfigError(
            f"strategy={strategy!r} is not allowed: use one of {', '.join(STRATEGIES)}"
        )
    kind = optimizer_kind(optimizer)
    batch = as_call(sample_batch).batch_size
    if chunks < 1 or chunks > batch:
        raise ConfigError(
            f"chunks={chunks} is not allowed for a batch of {batch}: use 1..{batch} micro-batches"
        )
    if chunks > 1 and strategy != "pipeline":
        raise ConfigError(
            f"chunks={chunks} only applies to strategy='pipeline' (got {strategy!r}); for "
            "smaller micro-batches on one device estimate the micro-batch itself"
        )
    if strategy == "single":
        n = 1
    elif devices:
        n = len(devices)
    elif strategy in ("split", "pipeline") and balance is not None and not isinstance(balance, str):
        n = len(balance)
    else:
        n = world_size
    if n < 1 or (devices is not None and strategy != "single" and world_size not in (1, n)):
        raise ConfigError(
            f"world_size={world_size} with devices={list(devices or [])} is inconsistent: "
            "give the number of ranks/stages (world_size) or name the devices, not both"
        )
    names = _device_names(n, devices)
    # a sequential view passes one input from layer to layer: a dict or tuple sample
    # goes through the model's own forward instead
    view = sequential_layers(model, sample_batch)
    if view is None and strategy in ("split", "pipeline"):
        if sequential_layers(model) is not None:
            raise ConfigError(
                f"{strategy!r} passes one tensor from stage to stage, but the sample batch "
                f"is {_sample_kind(sample_batch)}, which {type(model).__name__}'s stages "
                "cannot take: estimate 'single', 'ddp' or 'fsdp' for it, or give a sample "
                "that is the first layer's one input"
            )
        raise ConfigError(
            f"{type(model).__name__} has no sequential view, so {strategy!r} cannot be "
            "estimated: pass an nn.Sequential or give the model an as_sequential() method "
            "returning its layers in order"
        )

    micro = -(-batch // chunks)

    def get_profile(rows: int) -> ActivationProfile:
        if profile is not None and profile.batch_size == rows and profile.precision == precision:
            return profile
        sample = sample_batch if rows == batch else _sample_slice(sample_batch, rows)
        return measure_activations(model, sample, precision, loss_fn)

    prof = get_profile(micro)
    if view is None and activation_checkpointing and not prof.block_names:
        if sequential_layers(model) is not None:
            raise ConfigError(
                f"{type(model).__name__} is checkpointed in segments of its sequential "
                f"view, which takes one input, but the sample batch is "
                f"{_sample_kind(sample_batch)} and the model has no repeated block: "
                "estimate without checkpointing"
            )
        raise ConfigError(
            f"{type(model).__name__} has no sequential view and no repeated block, so "
            "activation checkpointing cannot be estimated (nor applied without naming "
            "blocks): give the model as_sequential() returning its layers in order, or "
            "estimate without checkpointing"
        )
    workspace = 2 * -(-prof.largest_bytes // block_bytes) * block_bytes

    def common(acts: int, state: StateBytes, extra: int) -> tuple[DeviceMemory, ...]:
        return tuple(_device(name, state, acts, workspace, extra) for name in names)

    if strategy in ("single", "ddp", "fsdp"):
        if activation_checkpointing and view is None:
            acts = block_checkpointed_bytes(
                prof.rounded(block_bytes), prof.saved, prof.block_saved, prof.block_inputs
            )
        elif activation_checkpointing:
            assert view is not None
            acts = _stage_activations(prof, 0, len(view), True, block_bytes)
        else:
            acts = union_bytes(prof.rounded(block_bytes), prof.saved)
        tensors = module_tensors(model)
        if strategy == "fsdp":
            state = state_bytes(tensors, kind, block_bytes, shards=n)
            # the units wrap_data_parallel(mode="fsdp") gathers one at a time (tied
            # blocks together); parameters shared inside a unit count once
            units = sorted(
                (state_bytes(module_tensors(nn.ModuleList(u)), kind, block_bytes)
                 .parameters_bytes for u in shard_units(model)),
                reverse=True,
            )  # fmt: skip
            extra = sum(units[:2]) if n > 1 else 0
        else:
            state = state_bytes(tensors, kind, block_bytes)
            extra = state.gradients_bytes if strategy == "ddp" and n > 1 else 0
        devs = common(acts, state, extra)
        used_balance = None
    else:
        assert view is not None
        layers = list(view.children())

        def layer_costs() -> list[float]:
            sizes = prof.rounded(block_bytes)
            costs = []
            for i, layer in enumerate(layers):
                s = state_bytes(module_tensors(layer), kind, block_bytes)
                acts = union_bytes(sizes, prof.layer_saved[i]) * chunks
                costs.append(
                    float(s.parameters_bytes + s.gradients_bytes + s.optimizer_bytes + acts)
                )
            return costs

        used = _resolve_balance(balance, len(layers), n, layer_costs)
        devs_list = []
        start = 0
        for name, count in zip(names, used, strict=True):
            end = start + count
            stage = nn.Sequential(*layers[start:end])
            state = state_bytes(module_tensors(stage), kind, block_bytes)
            sizes = prof.rounded(block_bytes)
            internal = union_bytes(sizes, *prof.layer_saved[start:end])
            if strategy == "split" or chunks == 1:
                acts = _stage_activations(prof, start, end, activation_checkpointing, block_bytes)
            elif activation_checkpointing:
                acts = (chunks - 1) * union_bytes(sizes, prof.layer_inputs[start]) + internal
            else:
                acts = chunks * internal
            devs_list.append(_device(name, state, acts, workspace, 0, (start, end)))
            start = end
        devs = tuple(devs_list)
        used_balance = tuple(used)
    return MemoryEstimate(
        strategy=strategy,
        optimizer=kind,
        precision=precision,
        batch_size=batch,
        micro_batch_size=micro,
        chunks=chunks,
        activation_checkpointing=activation_checkpointing,
        balance=used_balance,
        devices=devs,
    )


__all__ = ["estimate_memory"]
