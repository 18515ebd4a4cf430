"""Measure a model's :class:`Footprint` with :func:`torchgpu.memory.estimate.estimate_memory`.

Everything comes from the estimator: exact arithmetic for parameters (and buffers),
gradients and optimizer state; activations measured once on fake tensors (so the
sample batch may be a ``device="meta"`` tensor of the real batch size: nothing of the
model's size is allocated); backward's temporaries (twice the largest saved tensor,
scaling with the batch) and the optimizer step's workspace (fixed), as the estimator
computes its peak; and the activations with checkpointing (ceil(sqrt(n)) segments of a
sequential model, or each repeated block of any other).
Per-layer figures for the split/pipeline rows come from the same activation profile:
each storage counted once, on the first layer that saved it.
"""

from __future__ import annotations

from torch import nn

from torchgpu.planning.footprint import Footprint, LayerFootprint


def measure_footprint(
    model: nn.Module,
    sample_batch: object,
    optimizer: str = "adam",
    precision: str = "fp32",
) -> Footprint:
    """The :class:`Footprint` of training ``model`` on ``sample_batch`` (the model's
    inputs of any structure, batch first, as :func:`~torchgpu.memory.estimate.estimate_memory`
    takes them; real, meta or fake: only shapes and dtypes are read).

    Raises :class:`ConfigError` (exit 2) for an unknown optimizer or precision, or a
    forward the estimator cannot run on fake tensors.
    """
    from torchgpu.memory.estimate import estimate_memory, measure_activations, optimizer_kind
    from torchgpu.memory.estimate.activations import sequential_layers
    from torchgpu.memory.estimate.arithmetic import CUDA_BLOCK_BYTES, module_tensors, state_bytes

    kind = optimizer_kind(optimizer)
    profile = measure_activations(model, sample_batch, precision)
    single = estimate_memory(model, sample_batch, kind, precision, profile=profile).devices[0]
    view = sequential_layers(model, sample_batch)  # None when the view cannot take the sample
    checkpointed = single.activations_bytes
    layers: list[LayerFootprint] = []
    if view is None and profile.block_names:  # checkpointing recomputes the repeated blocks
        checkpointed = (
            estimate_memory(
                model, sample_batch, kind, precision, activation_checkpointing=True, profile=profile
            )
            .devices[0]
            .activations_bytes
        )
    if view is not None and len(view) > 1:
        checkpointed = (
            estimate_memory(
                model, sample_batch, kind, precision, activation_checkpointing=True, profile=profile
            )
            .devices[0]
            .activations_bytes
        )
        sizes = profile.rounded(CUDA_BLOCK_BYTES)
        counted: set[int] = set()
        for index, (name, layer) in enumerate(view.named_children()):
            own = set(profile.layer_saved[index]) - counted
            counted |= own
            state = state_bytes(module_tensors(layer), kind)
            layers.append(
                LayerFootprint(
                    name=name,
                    param_bytes=state.parameters_bytes,
                    grad_bytes=state.gradients_bytes,
                    optimizer_bytes=state.optimizer_bytes,
                    activation_bytes=sum(sizes[k] for k in own),
                    input_bytes=sum(sizes[k] for k in profile.layer_inputs[index]),
                )
            )
    # backward's largest op: its input and output gradients (the estimator's own rule)
    largest = -(-profile.largest_bytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES
    step_workspace = state_bytes(module_tensors(model), kind).step_workspace_bytes
    return Footprint(
        batch_size=profile.batch_size,
        param_bytes=single.parameters_bytes,
        grad_bytes=single.gradients_bytes,
        optimizer_bytes=single.optimizer_bytes,
        activation_bytes=single.activations_bytes,
        checkpointed_activation_bytes=min(checkpointed, single.activations_bytes),
        transient_bytes=2 * largest,
        layers=tuple(layers),
        source=f"estimated on fake tensors at batch {profile.batch_size}",
        step_workspace_bytes=step_workspace,
        checkpointable=bool(profile.block_names) or view is not None,
    )
