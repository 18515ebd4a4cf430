"""The training loss read off an accelerator once per optimizer step, not per micro-batch.

A host read (``.item()``) waits for everything queued before it: between a forward and its
backward it would idle the device at every micro-batch. :class:`LossReader` keeps each
micro-batch's loss on the device (:meth:`LossReader.add`) and reads the window's, with DDP's
finite-guard probes, in one transfer from a step pre-hook on the optimizer: one host sync
per step, before ``optimizer.step`` touches the weights. A non-finite value raises
``NonFiniteGradients`` there, so a non-finite loss still never reaches the weights (its
gradients are dropped with the window). On the CPU a read is no sync and
``per_step_optimizer`` is None: the loop reads each loss as it comes.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from torchgpu.train.guards.agreement import NonFiniteGradients

if TYPE_CHECKING:
    from torchgpu.train.guards.agreement import FiniteGuard


def per_step_optimizer(device: torch.device, accumulator: Any) -> torch.optim.Optimizer | None:
    """The optimizer to hook when the loop reads the loss once per optimizer step (an
    accelerator, with a :class:`~torchgpu.accumulate.GradAccumulator`), None when it reads
    it once per micro-batch (the CPU, where reading costs no sync)."""
    from torchgpu.accumulate import GradAccumulator

    if device.type == "cpu" or not isinstance(accumulator, GradAccumulator):
        return None
    return accumulator.optimizer


class LossReader:
    """One window's losses, kept on the device until its optimizer step.

    ``guard``: DDP's finite guard (registered without its own hook): its probes ride in
    the same transfer and it judges them. Without it (one process) any non-finite loss
    of the window stops the step. Call :meth:`remove` when the epoch ends.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, guard: FiniteGuard | None) -> None:
        self.pending: list[Tensor] = []
        self._guard = guard
        self._values: list[float] | None = None
        self._probes: list[float] = []
        self._handle = optimizer.register_step_pre_hook(self._check)

    def add(self, loss: Tensor) -> None:
        """Keep one micro-batch's loss (no sync)."""
        self.pending.append(loss.detach())

    def take(self) -> list[float]:
        """The window's losses, in order (read now unless the step's check already read
        them), and a new window."""
        values = self._read()
        self.clear()
        return values

    def clear(self) -> None:
        """Forget the window (a replayed or dropped one)."""
        self.pending = []
        self._values = None
        self._probes = []

    def remove(self) -> None:
        self._handle.remove()

    def _read(self) -> list[float]:
        if self._values is not None:
            return self._values
        probes = self._guard.probes() if self._guard is not None else []
        tensors = self.pending + probes
        if not tensors:
            self._values, self._probes = [], []
            return self._values
        device = tensors[0].device
        # One transfer for the whole window: a reshape is a view, the cat one kernel.
        flat = torch.cat([t.reshape(-1).to(device=device, dtype=torch.float32)
                          for t in tensors]).tolist()
        count = sum(t.numel() for t in self.pending)
        self._values, self._probes = flat[:count], flat[count:]
        return self._values

    def _check(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # Read afresh: a window replayed by the OOM back-off steps again after a refused
        # step, and the probes (gradients) are new.
        self._values = None
        values = self._read()
        if self._guard is not None:  # DDP: the all-reduced probes decide, on every rank alike
            if not self._guard.judge(self._probes):
                raise NonFiniteGradients
        elif not all(math.isfinite(v) for v in values):
            raise NonFiniteGradients
