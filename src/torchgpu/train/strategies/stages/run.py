"""``--strategy pipeline --nproc N`` through the shared run driver: :class:`StageRun`.

Every rank builds the same seeded model, keeps its stage(s) (two per process with
``--schedule interleaved1f1b``) and iterates the same unsharded batches. Every batch runs
in ``--chunks`` micro-batches whatever its size, and the window weights batches by their
rows, so no batch is skipped and losses, gradients and metrics equal the one-process run's.
Checkpoints hold the whole model and every stage's optimizer state, so ``--resume``
continues exactly (keeping the saved ``--chunks auto`` choice). ``bf16`` runs each stage's
forward and the loss under autocast.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from torchgpu.launch.stop_record import StopFlag
from torchgpu.train.loop.parts import LoopParts, StepResult
from torchgpu.train.outputs.evaluation import EvalResult
from torchgpu.train.state import TrainState
from torchgpu.train.strategies.run_steps import RunSteps, StepContext
from torchgpu.train.strategies.split import check_splittable
from torchgpu.train.strategies.stages.state import StageOptimizers
from torchgpu.train.strategies.stages.trainer import StageTrainer


class _AgreedStop(StopFlag):
    """The stop flag as the ranks last agreed on it (in the step's all-reduce), so every
    rank stops at the same boundary; sets the run's own flag when it agrees to stop."""

    def __init__(self, flag: StopFlag) -> None:
        super().__init__()
        self.flag = flag

    def agree(self, seen: bool) -> None:
        if seen and not self.is_set():
            if not self.flag.is_set():
                self.flag.set("a stop on another rank")
            self.set(self.flag.signal_name or "request")


class StageWindow:
    """The pipeline's accumulation window, as the loop sizes and ends it: it counts the
    window's batches and rows; at the window's end :meth:`StageTrainer.apply` turns the
    summed gradients into their mean over those rows and steps; :meth:`reset` drops it."""

    def __init__(self, trainer: StageTrainer, window: int) -> None:
        self.trainer = trainer
        self.steps = window
        self.pending = 0
        self.window_samples: float | None = None
        self._rows = 0

    def add(self, rows: int) -> bool:
        """Count a batch whose gradients the schedule added; True when it ended the window
        (and the optimizer stepped)."""
        self.pending += 1
        self._rows += rows
        return self.flush() if self.pending >= self.steps else False

    def set_steps(self, steps: int, window_samples: float | None = None) -> None:
        self.steps = steps

    def zero_grad(self) -> None:
        """Nothing to free: :meth:`StageTrainer.apply` zeroes after its step."""

    def reset(self) -> None:
        self.trainer.drop_window()
        self.pending, self._rows = 0, 0

    def flush(self) -> bool:
        if not self.pending:
            return False
        self.trainer.apply(self._rows)
        self.pending, self._rows = 0, 0
        return True


class StageStep:
    """The pipeline's micro-step (``LoopParts.step``: the loop's branch for it). One batch
    runs through every stage, forward and backward in one schedule; the loss comes back
    agreed on every rank (NaN when the last stage saw a non-finite one, so every rank
    stops or skips alike, before :class:`StageWindow` counts it), with the stop flag the
    ranks agreed on in the same all-reduce (``agreed``: what the loop checks)."""

    def __init__(self, trainer: StageTrainer, stop: StopFlag, window: StageWindow) -> None:
        self.trainer, self.stop, self.window = trainer, stop, window
        self.agreed = _AgreedStop(stop)
        # What the step calls per batch: the schedule's loss, or the run hooks' wrapper of
        # it (they see the batch and this step's loss, as in every other strategy).
        self.loss: Callable[[Tensor, Tensor], Tensor] = self.schedule_loss
        self._stop_seen = False

    def __call__(self, x: Tensor, y: Tensor, samples: int, loss_fn: object) -> StepResult:
        value = float(self.loss(x, y))
        self.agreed.agree(self._stop_seen)
        if not math.isfinite(value):  # the loop applies --on-nonfinite (drops the window)
            return value, True, False, None
        return value, False, self.window.add(samples), None

    def schedule_loss(self, x: Tensor, y: Tensor) -> Tensor:
        """Every stage's forward and backward of one batch (its gradients added to the
        window's); the loss agreed on every rank, a float64 scalar on the host. The stop
        flag agreed in the same all-reduce is kept for the step."""
        self._stop_seen, value = self.trainer.forward_backward(x, y, self.stop.is_set())
        return torch.tensor(value, dtype=torch.float64)


def saved_chunks(checkpoint: Path | None) -> int | None:
    """The ``--chunks`` the run that wrote ``checkpoint`` trained with (its meta.json's
    resolved config), or None (no checkpoint, or none recorded)."""
    if checkpoint is None:
        return None
    from torchgpu.checkpoint.layout import read_meta

    chunks = (read_meta(checkpoint).get("config") or {}).get("chunks")
    return chunks if isinstance(chunks, int) and not isinstance(chunks, bool) else None


class StageRun(RunSteps):
    """What the multi-process stage pipeline supplies to the shared run driver
    (:mod:`torchgpu.train.strategies.run_steps`): :class:`StageStep` and
    ``StageWindow`` as the loop's step and window, the stop flag the ranks agree on,
    the forward-only evaluation, the whole model gathered on rank 0 for checkpoints and the
    final file, every stage's optimizer state (``StageOptimizers``) and the summary's
    ``pipeline`` entry. Call inside the process group, on every rank."""

    phase = "stages"  # a step waits on the stages' sends and receives, then one all-reduce
    record_world = 1  # every rank sees every sample: the throughput is one process's

    def __init__(self, ctx: StepContext) -> None:
        config, model, task = ctx.config, ctx.model, ctx.task
        check_splittable(model, task, "pipeline")  # fit() under torchrun: no launcher check
        resumed = saved_chunks(ctx.resume_from) if config.chunks == "auto" else None
        trainer = StageTrainer(model, config, ctx.device, task, ctx.precision, chunks=resumed)
        self.notes: tuple[str, ...] = ()
        if resumed is not None:
            self.notes = (f"--chunks auto: resuming with --chunks {resumed}, the split-size "
                          "sweep's choice of the run that saved the checkpoint",)
        elif config.chunks == "auto":
            trainer.sweep_chunks()
        # config.toml, checkpoints and the summary record the cut and the split the run
        # made (measured for --balance time and --chunks auto), so they reproduce it.
        config = dataclasses.replace(config, balance=",".join(map(str, trainer.balance)),
                                     chunks=trainer.chunks if config.chunks == "auto"
                                     else config.chunks)
        window = StageWindow(trainer, config.accumulate)
        step = StageStep(trainer, ctx.stop, window)
        position = ctx.position  # the hooks wrap the schedule's loss: before step N's sends
        step.loss = ctx.hooks.wrap_loss(step.loss, lambda: position()[0],
                                        before="stage schedule (its sends and receives)")
        self.parts = LoopParts(model=model, loss_fn=task.loss, accumulator=window,
                               precision=ctx.precision, device=ctx.device,
                               accumulate=config.accumulate, on_nonfinite=config.on_nonfinite,
                               rank=trainer.last_rank, step=step)
        self.config, self.trainer, self.task = config, trainer, task
        # The agreed flag: a step limit set on every rank at one boundary stops there; a
        # signal on one rank reaches the others in the next step's all-reduce.
        self.stop = step.agreed
        self.model = self.observed = self.result_model = model
        self.optimizer = StageOptimizers(trainer.optimizer, model, trainer.pipe.modules)

    def lines(self) -> tuple[str, ...]:
        t = self.trainer
        table = (f"split-size sweep, chose --chunks {t.chunks}:\n{t.chunk_table}",
                 ) if t.chunk_table is not None else ()
        checkpointing = ("activation checkpointing: each stage's layers in segments, all but "
                         "the last recomputed in backward",) \
            if self.config.activation_checkpointing else ()
        return (*self.notes, f"pipeline over {t.ranks} processes ({t.schedule}, {t.stages} "
                f"stages, balance {t.balance}, --chunks {t.chunks})", *checkpointing, *table)

    def before_save(self) -> None:
        self.trainer.gather()
        self.optimizer.gather()

    def evaluate(self, batches: Iterable[Any]) -> EvalResult:
        return self.trainer.evaluate(batches)

    def full_state(self) -> dict[str, Tensor]:
        self.trainer.gather()  # rank 0's model object: the whole trained model
        if dist.get_rank() != 0:
            return {}
        return {k: v.detach() for k, v in self.model.state_dict().items()
                if isinstance(v, Tensor)}

    def summarize(self, summary: dict[str, Any], state: TrainState,
                  train_seconds: float) -> None:
        t, config = self.trainer, self.config
        assert config.batch_size is not None
        # Every rank sees the whole batch: the global batch is one process's, not x world.
        summary["global_batch"] = config.batch_size * config.accumulate
        summary["throughput_samples_per_s"] = (state.samples / train_seconds if train_seconds
                                               else None)
        summary["pipeline"] = {"processes": t.ranks, "stages": t.stages,
                               "schedule": t.schedule, "balance": t.balance,
                               "chunks": t.chunks}
