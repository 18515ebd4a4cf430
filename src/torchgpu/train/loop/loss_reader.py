"""The training loss read off an accelerator once per optimizer step, not per micro-batch,
or one step late with no sync at all.

A host read (``.item()``) waits for everything queued before it: between a forward and its
backward it would idle the device at every micro-batch. :class:`LossReader` keeps each
micro-batch's loss on the device (:meth:`LossReader.add`) and reads the window's, with DDP's
finite-guard probes, in one transfer from a step pre-hook on the optimizer: one host sync
per step, before ``optimizer.step`` touches the weights. A non-finite value raises
``NonFiniteGradients`` there, so a non-finite loss still never reaches the weights (its
gradients are dropped with the window). On the CPU a read is no sync and
``per_step_optimizer`` is None: the loop reads each loss as it comes.

**Late reads** (``late=True``, see :func:`reads_late`): with an optimizer whose step takes
a device-side skip flag (torch's fused Adam, AdamW and SGD: ``found_inf``, what the fp16
GradScaler uses), the pre-hook instead computes "is any loss of the window non-finite" on
the device, hands it to the step (a non-finite window's update is skipped by the kernel,
its step count restored) and queues the losses' copy to pinned host memory with an event.
Nothing waits: the host runs ahead into the next batch, and the window's losses are read
when the next step's pre-hook runs (the copy is long done; the device still has that
step's forward and backward queued), where :attr:`LossReader.before_step` settles the
held window (its records, its ``on_step``, or its non-finite loss raised before the next
update). A non-finite loss still never reaches the weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from torchgpu.train.guards.agreement import NonFiniteGradients

if TYPE_CHECKING:
    from torchgpu.train.guards.agreement import FiniteGuard


def reads_late(optimizer: torch.optim.Optimizer, accumulator: Any, *, accumulate: int,
               on_nonfinite: str) -> bool:
    """Whether the loop may read a window's losses one step late (the module docstring):
    the optimizer skips a step on the device's word (``_step_supports_amp_scaling``: the
    fused kernels), no loss scaler sets that word itself, one micro-batch per step, and
    ``--on-nonfinite stop`` (``skip`` would have to take back a step already counted)."""
    return (bool(getattr(optimizer, "_step_supports_amp_scaling", False))
            and not getattr(accumulator, "scales_loss", True)
            and accumulate == 1 and on_nonfinite == "stop")


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

    def __init__(self, optimizer: torch.optim.Optimizer, guard: FiniteGuard | None, *,
                 late: bool = False) -> None:
        if late and guard is not None:
            raise ValueError("late reads are for one process: DDP's guard decides on the host")
        self.pending: list[Tensor] = []
        self._guard = guard
        self._values: list[float] | None = None
        self._probes: list[float] = []
        self.late = late
        # Late reads: the window's losses on their way to the host (the last step's).
        self._copy: LossCopy | None = None
        # Called first in every step's pre-hook: settles a window held since the last step.
        self.before_step: Callable[[], None] | None = None
        self._optimizer = optimizer
        self._handle = optimizer.register_step_pre_hook(
            self._check_late if late else self._check)

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
        self._copy = None

    def remove(self) -> None:
        self._handle.remove()
        self.before_step = None
        if self.late:  # the flag belongs to this reader's steps only
            self._optimizer.__dict__.pop("found_inf", None)
            self._optimizer.__dict__.pop("grad_scale", None)

    def copied(self) -> LossCopy | None:
        """Late reads: the last step's window on its way to the host, handed over (the
        reader forgets it); None when no step copied one."""
        copy, self._copy = self._copy, None
        return copy

    def _read(self) -> list[float]:
        if self._values is not None:
            return self._values
        copy = self.copied()
        if copy is not None:  # late reads, read now after all
            self._values = copy.values()
            return self._values
        probes = self._guard.probes() if self._guard is not None else []
        tensors = self.pending + probes
        if not tensors:
            self._values, self._probes = [], []
            return self._values
        flat = _flat(tensors).tolist()  # one transfer for the whole window
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

    def _check_late(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.before_step is not None:
            self.before_step()  # the last step's window: settled before this step
        if not self.pending:  # a step the back-off replays: it reads its losses itself
            optimizer.found_inf = None
            return
        flat = _flat(self.pending)
        bad = torch.isfinite(flat).all().logical_not().to(torch.float32)  # 0-dim, as the
        optimizer.found_inf = bad  # GradScaler's: the fused kernel skips on 1, no sync
        optimizer.grad_scale = None
        self._copy = LossCopy(flat)
        self.pending = []


def _flat(tensors: list[Tensor]) -> Tensor:
    """``tensors`` as one float32 vector on the first one's device (a reshape is a view,
    the cat one kernel)."""
    device = tensors[0].device
    return torch.cat([t.reshape(-1).to(device=device, dtype=torch.float32) for t in tensors])


class LossCopy:
    """A window's losses, copied to host memory without a sync:
    pinned memory and an event on CUDA; read (:meth:`values`) once the event has passed."""

    def __init__(self, payload: Tensor) -> None:
        self._event: Any = None
        if payload.device.type == "cuda":
            self._host = torch.empty(payload.shape, dtype=payload.dtype, pin_memory=True)
            self._host.copy_(payload, non_blocking=True)
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._event.record()
        else:  # the CPU (tests) and other devices: a plain copy
            self._host = payload.to("cpu")

    def values(self) -> list[float]:
        """The window's losses (waits for the copy only, not for later work)."""
        if self._event is not None:
            self._event.synchronize()
        flat: list[float] = self._host.tolist()
        return flat
