"""A model's training memory, device-independent: the numbers every strategy is priced from.

A :class:`Footprint` is measured once (:func:`torchgpu.planning.measure.measure_footprint`)
or written by hand in tests. Activation figures are for ``batch_size`` samples and scale
linearly with the batch (what autograd saves is per-sample tensors); model states
(parameters, gradients, optimizer state) do not depend on the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LayerFootprint:
    """One top-level layer of a splittable model (a child of ``as_sequential()``).

    ``activation_bytes``: saved for backward inside the layer at the footprint's batch;
    ``input_bytes``: the layer's input at that batch (what a pipeline stage that
    recomputes its layers keeps per micro-batch).
    """

    name: str
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    input_bytes: int

    @property
    def state_bytes(self) -> int:
        """Parameters + gradients + optimizer state (bytes)."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class Footprint:
    """Training memory of one model at ``batch_size`` samples, on one device (bytes).

    - ``param_bytes``, ``grad_bytes``, ``optimizer_bytes``: model states (exact).
    - ``activation_bytes``: saved for backward, no checkpointing.
    - ``checkpointed_activation_bytes``: saved for backward with activation
      checkpointing (segment inputs plus one segment recomputed at a time).
    - ``transient_bytes``: what the peak adds on top of states and saved activations
      (temporaries, the loss, workspace), also scaling with the batch.
    - ``layers``: the top-level layers for split/pipeline plans (empty: not splittable).
    - ``source``: how the activation numbers were obtained (for the table's footnote).
    - ``step_workspace_bytes``: temporaries of the optimizer step (Adam's foreach
      buffers); the step runs after backward has freed the activations, so the peak is
      ``states + max(activations + transient, step workspace)``.
    - ``checkpointable``: ``apply_activation_checkpointing(model)`` can take the model
      (it is sequential or has a repeated block); False rules the checkpointing rows out.
    """

    batch_size: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    checkpointed_activation_bytes: int
    transient_bytes: int = 0
    layers: tuple[LayerFootprint, ...] = field(default=())
    source: str = "given"
    step_workspace_bytes: int = 0
    checkpointable: bool = True

    @property
    def state_bytes(self) -> int:
        """Parameters + gradients + optimizer state (bytes)."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    def per_sample(self, value: int) -> float:
        """``value`` (a batch-scaled figure at ``batch_size``) per sample."""
        return value / max(self.batch_size, 1)

    def activations(self, batch: int, checkpointing: bool = False) -> int:
        """Bytes saved for backward at ``batch`` samples, with or without checkpointing."""
        base = self.checkpointed_activation_bytes if checkpointing else self.activation_bytes
        return math.ceil(self.per_sample(base) * batch)

    def transient(self, batch: int) -> int:
        """The peak's extra bytes at ``batch`` samples."""
        return math.ceil(self.per_sample(self.transient_bytes) * batch)

    def single_bytes(self, batch: int, checkpointing: bool = False) -> int:
        """Peak bytes of one training step at ``batch`` samples on one device."""
        return self.state_bytes + self.working(batch, checkpointing, self.step_workspace_bytes)

    def working(self, batch: int, checkpointing: bool, step_workspace_bytes: int) -> int:
        """Bytes on top of the model states at the step's high-water mark: backward's
        activations and temporaries, or the optimizer step's workspace if larger."""
        backward = self.activations(batch, checkpointing) + self.transient(batch)
        return max(backward, step_workspace_bytes)

    def largest_layer(self) -> LayerFootprint | None:
        """The layer with the most parameters (FSDP gathers one such unit at a time)."""
        return max(self.layers, key=lambda layer: layer.param_bytes, default=None)
