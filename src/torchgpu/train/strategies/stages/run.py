"""``torchgpu train --strategy pipeline --nproc N``: one pipeline stage per process.

Every rank builds the same seeded model and keeps its stage(s) of the sequential view
(:class:`torchgpu.parallel.stages.StagePipeline` on ``torch.distributed.pipelining``:
gloo on CPU, NCCL on GPU; ``--schedule gpipe|1f1b|interleaved1f1b``, the last with two
stages per process). Every rank iterates the same, unsharded batches (the order of the
one-process run): rank 0 feeds the inputs, the last rank the labels.

The run goes through the run driver every strategy shares
(:func:`torchgpu.train.runner.train`: checkpoints, observers, heartbeat, summary and
outputs) and its loop, :func:`torchgpu.train.loop.epoch.run_epoch`; :class:`StageRun` supplies
what differs: the steps (:class:`StageSteps`, the loop's loss and accumulator), the
evaluation, the whole model gathered on rank 0 and the summary's ``pipeline`` entry.
Per step the last rank has the loss; one small all-reduce gives every rank
``[non-finite, stop, loss]``, so the loop on every rank takes the same decision
(non-finite -> stop or skip, the stop flag at the same boundary) and rank 0, which
writes the metrics, has the loss.
Gradients accumulate over ``--accumulate`` batches, each weighted by its rows, and
become the mean over the window's samples (as one process does); ``--clip-norm``
clips the global norm (squared norms all-reduced over the stages). Evaluation runs a
forward-only schedule over the held-out split; the last rank computes the metrics
and broadcasts them. ``model.safetensors`` and checkpoints hold the whole model under
the plain model's keys, gathered on rank 0, and every stage's optimizer state keyed by
parameter (:mod:`torchgpu.train.strategies.stages.state`), so ``--save-every``/``--resume`` and a
stop continue exactly.

Every batch runs in ``--chunks`` micro-batches, whatever its size: the smaller last
batch, an odd test split and a batch that ``--chunks`` does not divide (which runs as
two schedules of equal micro-batches; see :mod:`torchgpu.parallel.stages`) — no batch
is skipped and the losses, gradients and metrics equal the one-process run's. Without
``--chunks`` the default (4 per stage) becomes the nearest equal split of the batch
when one is at least half as many (one schedule per step); ``--chunks auto`` sweeps the
equal splits (a resume keeps the choice of the run that saved it).

Precision: ``bf16`` runs each stage's forward and the loss under autocast (the
backward outside it); ``fp16`` is refused (see :mod:`torchgpu.train.strategies.stages.strategy`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from torchgpu.errors import first_line
from torchgpu.launch.stop_record import StopFlag
from torchgpu.train.loop.parts import LoopParts
from torchgpu.train.outputs.evaluation import EvalResult, evaluate
from torchgpu.train.state import TrainState
from torchgpu.train.strategies.run_steps import RunSteps, StepContext
from torchgpu.train.strategies.split import (
    check_splittable,
    default_chunks,
    parse_balance,
    sample_batch,
    stages_per_rank,
)
from torchgpu.train.strategies.stages.state import StageOptimizers, gather_weights

if TYPE_CHECKING:
    from torchgpu.precision import Precision
    from torchgpu.train.config import TrainConfig
    from torchgpu.train.task import Task

#: The profiler's name for a forward (torchgpu.train.observe.profiler.FORWARD_LABEL, which this
#: module cannot import: train.profiling imports the config, which imports the strategies).
FORWARD_LABEL = "torchgpu::forward"
LossFn = Callable[[Any, Any], Tensor]


def chunk_ok(m: int, rows: int, schedule: str, ranks: int, stages: int) -> bool:
    """Whether ``rows`` rows split into ``m`` *equal* micro-batches that ``schedule``
    runs as one schedule: ``m`` divides ``rows``, 1F1B has one per stage, interleaved
    1F1B a multiple of the ranks. Pure."""
    if m < 1 or rows % m:
        return False
    if schedule == "1f1b" and m < stages:
        return False
    return not (schedule == "interleaved1f1b" and m % ranks)


def chunks_for_rows(chunks: int, rows: int, schedule: str, ranks: int, stages: int) -> int | None:
    """The largest ``m <= chunks`` that :func:`chunk_ok` accepts for ``rows`` rows (one
    schedule of equal micro-batches); None when there is none (always some for gpipe). Pure."""
    for m in range(min(chunks, rows), 0, -1):
        if chunk_ok(m, rows, schedule, ranks, stages):
            return m
    return None


def default_stage_chunks(batch_rows: int, schedule: str, ranks: int, stages: int) -> int:
    """Micro-batches when ``--chunks`` is not given: 4 per stage (at most one per row,
    at least what the schedule needs), or the nearest equal split of the batch below
    that when it keeps at least half as many. Pure."""
    wanted = default_chunks(batch_rows, stages)
    if schedule == "1f1b":
        wanted = max(wanted, stages)
    elif schedule == "interleaved1f1b":
        wanted = -(-wanted // ranks) * ranks
    even = chunks_for_rows(wanted, batch_rows, schedule, ranks, stages)
    return even if even is not None and 2 * even >= wanted else wanted


class StageTrainer:
    """This rank's stage(s) (one :class:`StagePipeline`, any batch shape) and its optimizer."""

    def __init__(self, model: nn.Module, config: TrainConfig, device: torch.device,
                 data: Task, precision: Precision, chunks: int | None = None) -> None:
        from torchgpu.parallel.stages import StagePipeline

        assert config.batch_size is not None and config.lr is not None
        self.model, self.config, self.device = model, config, device
        self.loss_fn: LossFn = data.loss
        self.metrics = data.metrics
        self.precision = precision
        self.schedule = config.schedule or "gpipe"
        self.spr = stages_per_rank(self.schedule)
        self.ranks = dist.get_world_size()
        self.rank = dist.get_rank()
        self.stages = self.ranks * self.spr
        self.last_rank = self.ranks - 1
        x, y = sample_batch(data, config.batch_size)
        self.sample = (x, y)
        if chunks is not None:
            self.chunks = chunks
        elif isinstance(config.chunks, int):
            self.chunks = config.chunks
        else:
            self.chunks = default_stage_chunks(int(x.shape[0]), self.schedule, self.ranks,
                                               self.stages)
        balance = parse_balance(config.balance) if config.balance is not None else None
        autocast = precision.autocast if precision.dtype is not None else None
        self.pipe = StagePipeline(model, device=device, loss_fn=self.loss_fn,
                                  schedule=self.schedule, chunks=self.chunks, balance=balance,
                                  stages_per_rank=self.spr, sample=x, autocast=autocast,
                                  forward_label=FORWARD_LABEL if config.profile else None)
        self.balance = list(self.pipe.balance)
        if config.activation_checkpointing:
            # Per stage, as the one-process split does: the stages run their layers, never
            # the whole model's forward (where the run's wrap put its checkpointing).
            from torchgpu.memory.activation_checkpointing import (
                apply_activation_checkpointing,
            )

            for stage in self.pipe.modules:
                if len(stage) > 1:
                    apply_activation_checkpointing(stage)
        self.params = list(self.pipe.parameters())
        # The run's optimizer (the user's factory, else the task's default) over the stages.
        self.optimizer = data.make_optimizer(nn.ParameterList(self.params), config.lr)
        self.chunk_table: str | None = None

    # -- schedules -------------------------------------------------------------------
    def sweep_chunks(self) -> None:
        """``--chunks auto``: the split-size sweep over ranks on the sample batch, over
        the equal splits of at least two rows that the schedule runs in one go."""
        from torchgpu.parallel.chunks import even_candidates
        from torchgpu.parallel.stages import choose_stage_chunks

        x, y = self.sample
        rows = int(x.shape[0])
        candidates = [m for m in even_candidates(rows)
                      if chunk_ok(m, rows, self.schedule, self.ranks, self.stages)]
        choice = choose_stage_chunks(self.pipe, x, y, candidates or [self.chunks])
        self.pipe.chunks = self.chunks = choice.chunks
        self.chunk_table = choice.format()

    # -- one step ----------------------------------------------------------------------
    def forward_backward(self, x: Tensor, y: Tensor, stop_wanted: bool) -> tuple[bool, float]:
        """Run one batch through the pipeline; returns ``(stop_seen, loss)`` agreed on
        every rank (``loss`` is NaN when the last rank saw a non-finite one)."""
        pipe = self.pipe
        rows = int(x.shape[0])  # weight: the window sums rows x mean loss (see apply)
        loss = pipe.step(x if pipe.is_first else None, y if pipe.is_last else None,
                         rows=rows, weight=rows)
        value = float(loss) if loss is not None else 0.0
        bad, stop_seen, value = self._agree(value, stop_wanted)
        return stop_seen, (math.nan if bad else value)

    def _agree(self, value: float, stop_wanted: bool) -> tuple[bool, bool, float]:
        flags_device = self.device if self.device.type == "cuda" else torch.device("cpu")
        finite = math.isfinite(value)
        flags = torch.tensor(
            [0.0 if finite else 1.0, float(stop_wanted), value if finite else 0.0],
            dtype=torch.float64, device=flags_device)
        dist.all_reduce(flags, op=dist.ReduceOp.SUM)
        got = flags.tolist()
        return got[0] > 0, got[1] > 0, got[2]

    def apply(self, window_rows: int) -> None:
        """Turn the window's summed gradients (each batch weighted by its rows) into the
        mean over its ``window_rows`` samples — one big batch's gradient, also when the
        epoch's short last batch is in it — clip the global norm, step, zero."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if window_rows > 1:
            torch._foreach_mul_(grads, 1.0 / window_rows)
        clip = self.config.clip_norm
        if clip is not None:
            local = sum((g.detach().double().pow(2).sum() for g in grads),
                        torch.zeros((), dtype=torch.float64, device=self.device))
            dist.all_reduce(local, op=dist.ReduceOp.SUM)
            coef = min(1.0, clip / (math.sqrt(float(local)) + 1e-6))
            if coef < 1.0 and grads:
                torch._foreach_mul_(grads, coef)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def drop_window(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    # -- evaluation --------------------------------------------------------------------
    def evaluate(self, batches: Iterable[tuple[Tensor, Tensor]]) -> EvalResult:
        """Held-out metrics on every rank (computed on the last, broadcast from it). Each
        batch runs forward-only in the largest equal split up to one micro-batch per stage,
        so every row of every batch counts once."""
        last_outputs: list[tuple[Tensor, Tensor]] = []
        pipe = self.pipe
        pipe.train(False)
        try:
            for x, y in batches:
                rows = int(x.shape[0])
                m = chunks_for_rows(self.stages, rows, "gpipe", self.ranks, self.stages) or 1
                out = pipe.forward(x if pipe.is_first else None, rows=rows, chunks=m)
                if pipe.is_last:
                    last_outputs.append((out.detach(), y.to(self.device)))
        finally:
            pipe.train(True)
        result: EvalResult | Exception | None = None
        failed: Exception | None = None
        if pipe.is_last:  # the loss under autocast, as one process computes it
            try:
                result = evaluate(nn.Identity(), last_outputs, self.loss_fn,
                                  device=self.device, precision=self.precision,
                                  metrics=self.metrics)
            except Exception as error:  # a metric or the loss: every rank raises it, so
                failed = error  # they save the epoch together (the runner)
                result = _picklable(error)
        box: list[Any] = [result]
        dist.broadcast_object_list(box, src=self.last_rank)
        got = box[0]
        if isinstance(got, Exception):
            raise failed if failed is not None else got
        assert isinstance(got, EvalResult)
        return got

    # -- weights ---------------------------------------------------------------------
    def gather(self) -> None:
        """Every stage's weights into rank 0's model object (collective)."""
        gather_weights(self.model, self.pipe.modules)


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
        loss_fn: LossFn = steps.loss
        if ctx.hang is not None:  # test-only: block before step N's schedule (its sends)
            position = ctx.position
            loss_fn = ctx.hang.wrap(loss_fn, lambda: position()[0],
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


def _picklable(error: Exception) -> Exception:
    """``error`` if it pickles (to send it to the other ranks), else a RuntimeError
    holding its first line."""
    import pickle

    try:
        pickle.dumps(error)
    except Exception:
        return RuntimeError(first_line(error))
    return error
