"""Decisions every rank takes alike under DDP, without a collective on every step.

The loop must stop (or skip) a non-finite step, log the global batch's loss and honour a
stop request at the same optimizer-step boundary on every rank. A per-step all-reduce would
do it but costs a round trip per step (0.74x a hand-written DDP loop on CPU/gloo), so
:class:`FiniteGuard` decides non-finite steps from the already all-reduced gradients and
:class:`RankAgreement` all-reduces the stop flag and the losses about every ``period_s``
seconds and at the epoch end. Between agreements the recorded losses are this rank's own;
a stop is honoured at the first agreement after it, on every rank at the same boundary.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from torchgpu.launch.heartbeat import Heartbeat
from torchgpu.launch.stop_record import PEER_STOP, StopFlag
from torchgpu.train.state import TrainState

StepRecords = list[tuple[int, int, float]]


class NonFiniteGradients(Exception):
    """Raised by the finite guard before an optimizer step whose gradients hold NaN/inf.

    Internal to the training loop: it is caught there and turned into the
    ``--on-nonfinite`` decision (or the OOM back-off agreement); users see
    :class:`torchgpu.errors.NonFiniteLossError`.
    """


class FiniteGuard:
    """The DDP non-finite decision, taken locally from already all-reduced gradients.

    A rank whose loss is non-finite adds :meth:`poison` to it before backward, making the
    *sentinel* gradient (the parameter with the largest first dimension) NaN; the gradient
    all-reduce (or FSDP2's reduce-scatter) carries it to every rank, and a step pre-hook on the
    optimizer raises :class:`NonFiniteGradients` everywhere before the weights change. Only one
    element is read (checking every gradient costs tens of microseconds per step). With
    ``clip_norm`` set, the clip norm is checked too, which also catches finite losses with
    non-finite gradients. Call ``remove`` when done."""

    def __init__(self, accumulator: Any, *, hook: bool = True) -> None:
        optimizer = getattr(accumulator, "optimizer", None)
        if optimizer is None:
            raise TypeError(
                "the finite-gradient guard needs the accumulator's optimizer "
                "(accumulator.optimizer); use torchgpu.accumulate.GradAccumulator"
            )
        params = [p for group in optimizer.param_groups for p in group["params"]
                  if p.requires_grad]
        if not params:
            raise TypeError("the finite-gradient guard needs a parameter that requires grad")
        # The parameter with the largest first dimension: under FSDP2 (dim-0 shards) every
        # rank then holds a piece of its gradient to look at.
        self._sentinel: torch.Tensor = max(params, key=lambda p: p.shape[0] if p.dim() else 0)
        self._accumulator = accumulator
        self._clipped = getattr(accumulator, "clip_norm", None) is not None
        # hook=False: the caller reads probes() with its own data in one transfer and
        # asks judge() (torchgpu.train.loop.loss_reader, on accelerators).
        self._handle = optimizer.register_step_pre_hook(self._check) if hook else None

    def poison(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` plus a term whose gradient is NaN in every sentinel element."""
        return loss + self._sentinel.sum() * math.nan

    def poison_if_nonfinite(self, loss: torch.Tensor) -> torch.Tensor:
        """:meth:`poison` decided on the device: the term's factor is 0 for a finite
        ``loss`` (its gradient then adds nothing), NaN otherwise. No host sync."""
        factor = torch.where(torch.isfinite(loss.detach()), 0.0, math.nan)
        return loss + self._sentinel.sum() * factor

    def probes(self) -> list[torch.Tensor]:
        """The values :meth:`judge` decides on, still on the device: the sentinel
        gradient's first element (this rank's shard under FSDP2) and the clip norm."""
        found: list[torch.Tensor] = []
        grad = self._sentinel.grad
        if grad is not None:
            local = grad.to_local() if hasattr(grad, "to_local") else grad  # FSDP2: own shard
            if local.numel():
                found.append(local.detach().flatten()[:1])
        if self._clipped:
            norm = self._accumulator.last_grad_norm
            if isinstance(norm, torch.Tensor):
                found.append(norm.detach())
            elif norm is not None:
                found.append(torch.tensor(float(norm)))
        return found

    @staticmethod
    def judge(values: list[float]) -> bool:
        """True when the step may go on: every probe read is finite (a NaN sentinel means
        some rank's loss was not; a non-finite clip norm, its gradients)."""
        return all(math.isfinite(v) for v in values)

    def _check(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.judge([probe.item() for probe in self.probes()]):
            raise NonFiniteGradients

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()


class RankAgreement:
    """Periodic agreement across ranks on the stop flag and the logged losses.

    Call :meth:`begin` when an epoch (or the rest of one) starts, :meth:`boundary` at
    every optimizer-step boundary (every rank reaches the same boundaries), and
    ``agree`` at the epoch end; a True from either means "stop at this boundary",
    on every rank alike. ``every`` starts at ``first_every`` and then follows
    the measured step time so agreements are about ``period_s`` apart (never more than
    ``max_every`` steps, growing at most 8x per agreement); it is computed from reduced
    values, so every rank computes the same schedule. ``stop_agreed`` is sticky: once
    True it stays True (the run is stopping), across ``begin`` calls too.
    """

    def __init__(self, world_size: int, *, period_s: float = 0.5, first_every: int = 1,
                 max_every: int = 4096, heartbeat: Heartbeat | None = None) -> None:
        self.world_size = world_size
        self.heartbeat = heartbeat  # marks the agreement's all-reduce (hang reports)
        self.period_s = period_s
        self.every = max(1, first_every)
        self.max_every = max_every
        self.agreements = 0  # collectives issued (for tests and benchmarks)
        self.stop_agreed = False
        self._device: torch.device | None = None
        self._since = 0
        self._last = time.perf_counter()
        self._state: TrainState | None = None
        self._records: StepRecords = []
        self._stop: StopFlag | None = None
        self._synced_steps = 0
        self._synced_sum = 0.0

    @property
    def agreed_steps(self) -> int:
        """Optimizer steps whose recorded losses are already the global means."""
        return self._synced_steps

    def begin(self, state: TrainState, records: StepRecords, stop: StopFlag | None) -> None:
        """Start tracking ``state``; its losses so far are taken as already global.

        A stop agreed earlier is kept (:meth:`boundary` answers True at once): forgetting
        it here let a run whose stop was agreed at an epoch's end train on."""
        self._state, self._records, self._stop = state, records, stop
        self._synced_steps = len(state.step_losses)
        self._synced_sum = state.epoch_loss_sum
        self._since = 0
        self._last = time.perf_counter()

    def boundary(self) -> bool:
        """At an optimizer-step boundary: True when the ranks agreed to stop here.
        Issues the collective only when it is due (``every`` boundaries since the last)."""
        if self.stop_agreed:
            return True
        self._since += 1
        if self._since < self.every:
            return False
        return self.agree()

    def agree(self) -> bool:
        """Collective now (every rank, same boundary): make the pending losses global,
        agree on the stop flag, plan the next agreement. Returns the agreed stop."""
        import torch.distributed as dist

        state = self._state
        if state is None:
            raise RuntimeError("RankAgreement.agree() before begin()")
        now = time.perf_counter()
        local = [1.0 if self._stop is not None and self._stop.is_set() else 0.0,
                 now - self._last, state.epoch_loss_sum - self._synced_sum,
                 *state.step_losses[self._synced_steps:]]
        buffer = torch.tensor(local, dtype=torch.float64, device=self._comm_device())
        if self.heartbeat is None:
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
        else:
            with self.heartbeat.during("agreement"):
                dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
        got = buffer.tolist()
        world = self.world_size
        self.agreements += 1
        state.epoch_loss_sum = self._synced_sum + got[2] / world
        means = [v / world for v in got[3:]]
        state.step_losses[self._synced_steps:] = means
        self._patch_records(state.step, means)
        self._plan(got[1] / world, self._since)
        self._synced_steps = len(state.step_losses)
        self._synced_sum = state.epoch_loss_sum
        self._since = 0
        self._last = time.perf_counter()
        if got[0] > 0 and not self.stop_agreed:
            self.stop_agreed = True
            self._share_stop(state.step)
        return self.stop_agreed

    def _share_stop(self, step: int) -> None:
        """Once, when the ranks agreed to stop (every rank, same boundary): see
        :func:`share_stop`."""
        share_stop(self._stop, step)

    def _patch_records(self, last_step: int, means: list[float]) -> None:
        # The records of the pending steps are the newest ones, if nobody took them yet.
        first = last_step - len(means) + 1
        for index in range(len(self._records) - 1, -1, -1):
            step, epoch, _ = self._records[index]
            if step < first:
                break
            if step <= last_step:
                self._records[index] = (step, epoch, means[step - first])

    def _plan(self, seconds: float, steps: int) -> None:
        if steps <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        wanted = int(self.period_s / (seconds / steps))
        self.every = max(1, min(self.max_every, wanted, self.every * 8))

    def _comm_device(self) -> torch.device:
        if self._device is None:
            import torch.distributed as dist

            backend = str(dist.get_backend()).lower()
            self._device = (torch.device("cuda", torch.cuda.current_device())
                            if "nccl" in backend else torch.device("cpu"))
        return self._device


def share_stop(stop: StopFlag | None, step: int) -> None:
    """Collective, once, where the ranks agreed to stop (every rank, at the same
    boundary): gather why each rank stopped and at which ``step``, so the flag of a rank
    that got no signal names the rank that did (``"SIGTERM on rank 1"``) and
    ``stop.steps_by_rank`` holds one step per rank. Any strategy's stop goes through it
    (the DDP agreement; the stage pipeline's, whose ranks only agreed on a bool)."""
    import torch.distributed as dist

    own = stop.signal_name if stop is not None else None
    mine = None if own in (None, PEER_STOP) else own  # a reason of this rank's own
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (mine, step))
    if stop is None:
        return
    if mine is None:  # the stop came from another rank's flag
        reason = next(((r, name) for r, (name, _) in enumerate(gathered) if name), None)
        stop.signal_name = f"{reason[1]} on rank {reason[0]}" if reason else PEER_STOP
        stop.set(stop.signal_name)
    stop.steps_by_rank = [int(s) for _, s in gathered]
