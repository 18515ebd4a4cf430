"""What ``torchgpu train`` runs per step, assembled the way ``train/runner.py`` assembles it,
for the ``overhead`` suite.

:func:`loop_parts` builds :class:`~torchgpu.train.loop.parts.LoopParts` with the same calls and
arguments as the runner's ``_Run`` for one process: the built-in examples' optimizer
(Adam, :mod:`torchgpu.examples.common`, made by :func:`torchgpu.train.recipe.optimizers.make`),
``GradAccumulator`` with the Precision and clip norm, the example's loss (the housing
example's MSE unless another is given), the label device from ``output_device``, the
loader's shard layout, and the OOM back-off from
``train.backoff.for_run`` (armed for strategy "single": every window's batches are held
for a replay). :func:`TrainEpoch`
calls ``run_epoch`` with what the runner passes per epoch: the stop flag, the per-step
hook (the LR record, no checkpoint without ``--save-every``, the timed flush of step
records to a metrics.jsonl in a temporary directory), a progress sink and the
step-record buffer;
on CUDA the batches go through the ``Prefetcher``, as in the runner.

Left out, because they run once per epoch or per run, not per step: evaluation, metrics
flush to disk, checkpoint files, signal handlers. A test compares these parts field by
field with the ones a real ``train()`` call builds, so the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from torchgpu.train.loop.parts import LoopParts
    from torchgpu.train.state import TrainState

Batches = Sequence[tuple[Tensor, Tensor]]


def loop_parts(model: nn.Module, device: torch.device, *, batch_size: int, lr: float,
               loss_fn: Callable[[Any, Any], Tensor] | None = None,
               precision: str = "fp32", accumulate: int = 1,
               clip_norm: float | None = None, on_nonfinite: str = "stop",
               mode: str = "single", state: TrainState | None = None,
               samples: int | None = None,
               optimizer: torch.optim.Optimizer | None = None) -> LoopParts:
    """``LoopParts`` for ``model`` on ``device``, exactly as the runner builds them for one
    process of strategy ``mode`` (``loss_fn``: the task's loss, default the housing
    example's MSE; ``state``: the TrainState the back-off reports from; ``samples``: the
    epoch's sample count, for the loader's shard layout; ``optimizer``: one built already
    over ``model``'s parameters, e.g. the one the overhead suite's loops share, instead of
    a new one made the runner's way)."""
    from torchgpu.accumulate import GradAccumulator
    from torchgpu.data.shards import ShardLayout
    from torchgpu.examples.common import OPTIMIZER
    from torchgpu.parallel.model import placed_output_device
    from torchgpu.precision import Precision
    from torchgpu.train import strategies
    from torchgpu.train.loop.backoff import for_run as backoff_for_run
    from torchgpu.train.loop.parts import LoopParts
    from torchgpu.train.recipe import optimizers
    from torchgpu.train.state import TrainState

    progress_state = state if state is not None else TrainState()
    mixed = Precision(precision, device)
    if optimizer is None:
        optimizer = optimizers.make(OPTIMIZER,
                                    [p for p in model.parameters() if p.requires_grad], lr)
    acc = GradAccumulator(model, optimizer, accumulate, precision=mixed, clip_norm=clip_norm,
                          zero_after_step=False)
    loss_fn = loss_fn if loss_fn is not None else nn.MSELoss()
    target_device = placed_output_device(model)
    if target_device == device:
        target_device = None
    return LoopParts(model=model, loss_fn=loss_fn, accumulator=acc, precision=mixed,
                     device=device, accumulate=accumulate,
                     move_batches=device.type not in ("cpu", "cuda"),
                     on_nonfinite=on_nonfinite, rank=0, agree=False,
                     target_device=target_device,
                     backoff=None if strategies.get(mode).features.backoff is not None
                     else backoff_for_run(model, acc, loss_fn, mixed,
                                          batch_size=batch_size, accumulate=accumulate,
                                          device=device, distributed=False, out_dir=None,
                                          position=lambda: (progress_state.step,
                                                            progress_state.epoch)),
                     agreement=None,
                     # The runner's loader (one process) carries this layout: the loop uses
                     # it to weight an epoch's short last batch.
                     layout=ShardLayout(samples, 1, batch_size) if samples is not None
                     else None)


class TrainEpoch:
    """One call = one epoch over ``batches`` through ``run_epoch``, as the runner calls it.

    The state carries over between calls (epoch after epoch, as in a run); the step
    records are cleared at each epoch's start, as the runner's per-epoch flush does.
    """

    def __init__(self, model: nn.Module, device: torch.device, batches: Batches, *,
                 batch_size: int, lr: float,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        from torchgpu.launch.stop_record import StopFlag
        from torchgpu.train.observe.progress import NullProgress
        from torchgpu.train.outputs.files import MetricsBuffer
        from torchgpu.train.state import TrainState

        self.state = TrainState()
        self.parts = loop_parts(model, device, batch_size=batch_size, lr=lr, state=self.state,
                                samples=sum(int(x.shape[0]) for x, _ in batches),
                                optimizer=optimizer)
        self.batches = batches
        self.device = device
        self.stop = StopFlag()
        self.buffer = MetricsBuffer()
        import tempfile

        from torchgpu.train import schedule
        from torchgpu.train.outputs.step_log import StepLog

        # the runner's on_step without --save-every: the LR record and the timed flush
        self._out = tempfile.TemporaryDirectory(prefix="torchgpu-bench-")
        from torchgpu.accumulate import GradAccumulator

        accumulator = self.parts.accumulator
        assert isinstance(accumulator, GradAccumulator)  # loop_parts builds one
        self.on_step = StepLog(Path(self._out.name), self.buffer, None, lambda: None).wrap(
            schedule.step_hook(accumulator.optimizer, None, None))
        # `--progress auto` off a terminal and `--json` runs get a sink whose update does
        # nothing; the loop still reads the clock for it every step, as here.
        self.progress = NullProgress()

    def __call__(self) -> None:
        from torchgpu.train.loop.epoch import run_epoch
        from torchgpu.transfer import Prefetcher

        state = self.state
        state.begin_epoch(state.epoch)
        self.buffer.steps.clear()
        batches: Iterable[tuple[Tensor, Tensor]] = self.batches
        if self.device.type == "cuda":  # copies overlap compute on a side stream
            batches = iter(Prefetcher(batches, self.device))
        run_epoch(self.parts, batches, state, batches_per_epoch=len(self.batches),
                  stop=self.stop, on_step=self.on_step, progress=self.progress,
                  records=self.buffer.steps, settle=_no_save,
                  ahead=None, ahead_left=0)  # batches made before: no workers to start
        state.begin_epoch(state.epoch + 1)


def _no_save(step: int) -> bool:
    """The runner's ``settle`` without ``--save-every``: no step needs its exact state."""
    return False
