"""``--strategy pipeline --nproc N`` through the run driver every strategy shares:
:class:`StageRun` supplies what differs from the other strategies.

Every rank builds the same seeded model and keeps its stage(s) of the sequential view
(:class:`~torchgpu.train.strategies.stages.trainer.StageTrainer`; ``--schedule
gpipe|1f1b|interleaved1f1b``, the last with two stages per process) and iterates the
same, unsharded batches (the one-process order): rank 0 feeds the inputs, the last rank
the labels. :class:`StageRun` gives the loop (:func:`torchgpu.train.loop.epoch.run_epoch`)
:class:`StageSteps` as its loss and accumulator (gradients accumulate over
``--accumulate`` batches weighted by their rows, as one process does), the stop flag
the ranks agree on in each step's all-reduce, the forward-only evaluation, the whole
model gathered on rank 0 for checkpoints and ``model.safetensors`` with every stage's
optimizer state (:mod:`.state`: ``--save-every``/``--resume`` continue exactly), and the
summary's ``pipeline`` entry. Every batch runs in ``--chunks`` micro-batches whatever its
size, so no batch is skipped and losses, gradients and metrics equal the one-process
run's; ``--chunks auto`` sweeps the equal splits (a resume keeps the saved choice).
``bf16`` runs each stage's forward and the loss under autocast; ``fp16`` is refused
(:mod:`.strategy`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from torchgpu.launch.stop_record import StopFlag
from torchgpu.train.loop.parts import LoopParts
from torchgpu.train.outputs.evaluation import EvalResult
from torchgpu.train.state import TrainState
from torchgpu.train.strategies.run_steps import RunSteps, StepContext
from torchgpu.train.strategies.split import (
    check_splittable,
)
from torchgpu.train.strategies.stages.state import StageOptimizers
from torchgpu.train.strategies.stages.trainer import StageTrainer

if TYPE_CHECKING:
    pass

LossFn = Callable[[Any, Any], Tensor]


class _Inputs(nn.Module):
    """:func:`run_epoch`'s "model" for the stage pipeline: hands the inputs on; the
    forward and backward of every stage run in :meth:`StageSteps.loss`."""

    def forward(self, x: Tensor) -> Tensor:
        return x


class _NoAutocast:
    dtype = None  # fp32: run_epoch enters no context

    def autocast(self) -> AbstractContextManager[Any]:
        return nullcontext()


NO_AUTOCAST = _NoAutocast()


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


class StageSteps:
    """One batch of the stage pipeline as :func:`~torchgpu.train.loop.epoch.run_epoch` takes it.

    ``loss(inputs, y)`` runs the batch through every stage (forward and backward in one
    schedule) and returns the loss agreed on every rank (NaN when the last stage saw a
    non-finite one, so every rank raises or skips alike); as the loop's accumulator it
    counts the window's rows and, at the window's end, turns the summed gradients into
    their mean and steps (:meth:`StageTrainer.apply`); ``reset`` drops the window.
    ``agreed`` is the stop flag the loop checks: the value the ranks agreed on.
    """

    def __init__(self, trainer: StageTrainer, stop: StopFlag, window: int) -> None:
        self.trainer, self.stop = trainer, stop
        self.agreed = _AgreedStop(stop)
        self.steps = window
        self.pending = 0
        self.window_samples: float | None = None
        self._rows = 0

    def loss(self, x: Tensor, y: Tensor) -> Tensor:
        stop_seen, value = self.trainer.forward_backward(x, y, self.stop.is_set())
        self.agreed.agree(stop_seen)
        return torch.tensor(value, dtype=torch.float64)

    def micro_step(self) -> AbstractContextManager[Any]:
        return nullcontext()  # the schedule accumulates: nothing to suppress

    def backward(self, loss: Tensor, samples: int | None = None) -> bool:
        """Count the batch (its gradients are in already); step at the window's end."""
        self.pending += 1
        self._rows += int(samples or 0)
        if self.pending < self.steps:
            return False
        return self.flush()

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
    (:mod:`torchgpu.train.strategies.run_steps`): :class:`StageSteps` as the loop's loss and
    accumulator, the stop flag the ranks agree on, the forward-only evaluation, the whole
    model gathered on rank 0 for checkpoints and the final file, every stage's optimizer
    state (:class:`~torchgpu.train.strategies.stages.state.StageOptimizers`) and the summary's
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
        steps = StageSteps(trainer, ctx.stop, config.accumulate)
        position = ctx.position  # the hooks' loss goes before step N's schedule (its sends)
        loss_fn: LossFn = ctx.hooks.wrap_loss(steps.loss, lambda: position()[0],
                                              before="stage schedule (its sends and receives)")
        self.parts = LoopParts(model=_Inputs(), loss_fn=loss_fn, accumulator=steps,
                               precision=NO_AUTOCAST, device=ctx.device,
                               accumulate=config.accumulate, on_nonfinite=config.on_nonfinite,
                               rank=trainer.last_rank)
        self.config, self.trainer, self.task = config, trainer, task
        # The agreed flag: a step limit set on every rank at one boundary stops there; a
        # signal on one rank reaches the others in the next step's all-reduce.
        self.stop = steps.agreed
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
