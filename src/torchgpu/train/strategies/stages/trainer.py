"""This rank's stage(s) of ``--strategy pipeline --nproc N`` and its optimizer:
:class:`StageTrainer` runs one step's schedule (forward and backward of every
micro-batch on every stage at once), agrees on ``[non-finite, stop, loss]`` in one small
all-reduce, applies the accumulated step (``--clip-norm`` over the stages' global norm),
runs the forward-only evaluation and gathers the whole model on rank 0; the
``--chunks`` helpers pick the equal splits a schedule can run in one go.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from torchgpu.errors import first_line
from torchgpu.train.outputs.evaluation import EvalResult, evaluate
from torchgpu.train.strategies.split import (
    default_chunks,
    parse_balance,
    sample_batch,
    stages_per_rank,
)
from torchgpu.train.strategies.stages.state import gather_weights

if TYPE_CHECKING:
    from torchgpu.precision import Precision
    from torchgpu.train.config import TrainConfig
    from torchgpu.train.task import Task

#: The profiler's name for a forward (:data:`torchgpu.train.observe.profiler.FORWARD_LABEL`:
#: the observers read the strategies, so this side spells it out).
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
        from torchgpu.parallel.stage_chunks import choose_stage_chunks

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


def _picklable(error: Exception) -> Exception:
    """``error`` if it pickles (to send it to the other ranks), else a RuntimeError
    holding its first line."""
    import pickle

    try:
        pickle.dumps(error)
    except Exception:
        return RuntimeError(first_line(error))
    return error
