"""``torchgpu train --strategy pipeline --nproc N``: one pipeline stage per process.

Every rank builds the same seeded model and keeps its stage(s) of the sequential view
(:class:`torchgpu.parallel.stages.StagePipeline` on ``torch.distributed.pipelining``:
gloo on CPU, NCCL on GPU; ``--schedule gpipe|1f1b|interleaved1f1b``, the last with two
stages per process). Every rank iterates the same, unsharded batches (the order of the
one-process run): rank 0 feeds the inputs, the last rank the labels.

The steps run in the engine's loop, :func:`torchgpu.train.loop.run_epoch`, through
:class:`StageSteps` (its loss and accumulator). Per step the last rank has the loss;
one small all-reduce gives every rank ``[non-finite, stop, loss]``, so the loop on
every rank takes the same decision (non-finite -> stop or skip, the stop flag at the
same boundary) and rank 0, which writes the metrics, has the loss.
Gradients accumulate over ``--accumulate`` batches, each weighted by its rows, and
become the mean over the window's samples (as one process does); ``--clip-norm``
clips the global norm (squared norms all-reduced over the stages). Evaluation runs a
forward-only schedule over the held-out split; the last rank computes the metrics
and broadcasts them. At the end the stages' weights are gathered on rank 0 under the
plain model's keys, so ``model.safetensors`` loads into the unsplit model.

Every batch runs in ``--chunks`` micro-batches, whatever its size: the smaller last
batch, an odd test split and a batch that ``--chunks`` does not divide (which runs as
two schedules of equal micro-batches; see :mod:`torchgpu.parallel.stages`) — no batch
is skipped and the losses, gradients and metrics equal the one-process run's. Without
``--chunks`` the default (4 per stage) becomes the nearest equal split of the batch
when one is at least half as many (one schedule per step); ``--chunks auto`` sweeps the
equal splits. Only fp32 is supported.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from torchgpu.distributed import DistEnv
from torchgpu.errors import UsageError
from torchgpu.train import build, outputs
from torchgpu.train.config import TrainConfig
from torchgpu.train.evaluation import EvalResult, evaluate
from torchgpu.train.loop import LoopParts, run_epoch, start_epoch
from torchgpu.train.outputs import EpochRecord, MetricsBuffer
from torchgpu.train.progress import NullProgress, make_progress
from torchgpu.train.report import (
    TrainResult,
    epoch_record,
    gather,
    memory_reader,
    peak_memory,
    summary_of,
)
from torchgpu.train.shard import Shard
from torchgpu.train.split_flags import parse_balance, stages_per_rank
from torchgpu.train.split_strategies import default_chunks, sample_batch
from torchgpu.train.state import StopFlag, TrainState

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
                 loss_fn: LossFn, data: Any) -> None:
        from torchgpu.parallel.stages import StagePipeline

        assert config.batch_size is not None and config.lr is not None
        self.model, self.config, self.device, self.loss_fn = model, config, device, loss_fn
        self.schedule = config.schedule or "gpipe"
        self.spr = stages_per_rank(self.schedule)
        self.ranks = dist.get_world_size()
        self.rank = dist.get_rank()
        self.stages = self.ranks * self.spr
        self.last_rank = self.ranks - 1
        x, y = sample_batch(data, config.batch_size)
        self.sample = (x, y)
        if isinstance(config.chunks, int):
            self.chunks = config.chunks
        else:
            self.chunks = default_stage_chunks(int(x.shape[0]), self.schedule, self.ranks,
                                               self.stages)
        balance = parse_balance(config.balance) if config.balance is not None else None
        self.pipe = StagePipeline(model, device=device, loss_fn=loss_fn, schedule=self.schedule,
                                  chunks=self.chunks, balance=balance,
                                  stages_per_rank=self.spr, sample=x)
        self.balance = list(self.pipe.balance)
        self.params = list(self.pipe.parameters())
        self.optimizer = build.make_optimizer(nn.ParameterList(self.params), config.lr)
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
    def evaluate(self, batches: Iterable[tuple[Tensor, Tensor]], task: str) -> EvalResult:
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
        result: EvalResult | None = None
        if pipe.is_last:
            result = evaluate(nn.Identity(), last_outputs, self.loss_fn, task=task,
                              device=self.device)
        box: list[Any] = [result]
        dist.broadcast_object_list(box, src=self.last_rank)
        got: EvalResult = box[0]
        return got

    # -- weights -----------------------------------------------------------------------
    def full_state(self) -> dict[str, Tensor]:
        """The whole model's weights under the plain model's keys, on rank 0 (empty
        elsewhere): each rank sends the tensors its stages own. Collective."""
        own = {id(t) for m in self.pipe.modules for t in [*m.parameters(), *m.buffers()]}
        mine = {k: v.detach().to("cpu").contiguous()
                for k, v in self.model.state_dict(keep_vars=True).items()
                if isinstance(v, Tensor) and id(v) in own}
        gathered: list[Any] = [None] * self.ranks if self.rank == 0 else []
        dist.gather_object(mine, gathered if self.rank == 0 else None, dst=0)
        merged: dict[str, Tensor] = {}
        for part in gathered:
            merged.update(part)
        return merged


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
    """One batch of the stage pipeline as :func:`~torchgpu.train.loop.run_epoch` takes it.

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


def train_stages(config: TrainConfig, env: DistEnv, device: torch.device, data: Any,
                 model: nn.Module, out_dir: Path | None, notes: tuple[str, ...],
                 stop: StopFlag) -> TrainResult:
    """Train ``model`` as a pipeline over the processes of the current group; returns a
    :class:`~torchgpu.train.report.TrainResult` (``model`` is this rank's full model
    object, of which only its stages were trained). Call inside the process group."""
    from torchgpu.data import make_loader

    # fp32 only, no resume, back-off or auto batch: declared (with the reasons) by
    # torchgpu.train.strategies.stages and refused by validate() before this runs.
    assert config.batch_size is not None and config.epochs is not None
    from torchgpu.train.split_strategies import check_splittable
    from torchgpu.train.task import as_task

    data = as_task(data, config)
    check_splittable(model, data, "pipeline")
    if data.test is None:
        raise UsageError(
            "--strategy pipeline with several processes evaluates on held-out data each "
            "epoch: give the data spec a (train, eval) pair, or run the pipeline in one "
            "process (--devices ... without --nproc)."
        )
    loss_fn = data.loss
    trainer = StageTrainer(model, config, device, loss_fn, data)
    if config.chunks == "auto":
        trainer.sweep_chunks()
    # Unsharded: every rank walks the one-process order (rank 0 needs x, the last rank y).
    train_loader = make_loader(data.train, config.batch_size, shuffle=True, seed=config.seed,
                               dist=Shard(0, 1), device=device, num_workers=config.num_workers)
    test_loader = make_loader(data.test, max(config.batch_size, 256), shuffle=False,
                              device=device)
    is_main = out_dir is not None
    progress = (NullProgress() if config.json else
                make_progress(config.progress, is_main=is_main, memory=memory_reader(device)))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        for note in notes:
            print(note, file=sys.stderr)
        print(f"pipeline over {trainer.ranks} processes ({trainer.schedule}, "
              f"{trainer.stages} stages, balance {trainer.balance}, --chunks {trainer.chunks})",
              file=sys.stderr)
        if trainer.chunk_table is not None:
            print(f"split-size sweep, chose --chunks {trainer.chunks}:\n{trainer.chunk_table}",
                  file=sys.stderr)
    state, buffer = TrainState(), MetricsBuffer()
    records: list[EpochRecord] = []
    batches_per_epoch = len(train_loader)
    steps = StageSteps(trainer, stop, config.accumulate)
    parts = LoopParts(model=_Inputs(), loss_fn=steps.loss, accumulator=steps,
                      precision=NO_AUTOCAST, device=device, accumulate=config.accumulate,
                      on_nonfinite=config.on_nonfinite, rank=trainer.last_rank)
    train_seconds = 0.0
    started = time.perf_counter()
    progress.start(config.epochs, batches_per_epoch, 0)
    try:
        with stop.installed():
            for epoch in range(config.epochs):
                state.begin_epoch(epoch)
                totals = run_epoch(parts, start_epoch(train_loader, config.seed, epoch), state,
                                   batches_per_epoch=batches_per_epoch, stop=steps.agreed,
                                   progress=progress, records=buffer.steps)
                train_seconds += totals.seconds
                if totals.stopped:
                    break
                result = trainer.evaluate(test_loader, data.kind)
                record = epoch_record(state, result, totals.samples, totals.seconds, 1)
                records.append(record)
                state.epoch_losses.append((record.train_loss, record.test_loss))
                if out_dir is not None:
                    outputs.flush_epoch(out_dir, buffer, record)
                progress.end_epoch(record, config.epochs)
    finally:
        progress.close()
    final_state = trainer.full_state()
    peaks = gather((str(device), build.device_name(device), peak_memory(device)), True)
    summary = summary_of(config, data, "pipeline", env.world_size, state, records, peaks,
                       train_seconds, time.perf_counter() - started, stop, "fp32")
    # Every rank sees the whole batch: the global batch is one process's, not x world.
    summary["global_batch"] = config.batch_size * config.accumulate
    summary["throughput_samples_per_s"] = (state.samples / train_seconds if train_seconds
                                           else None)
    summary["pipeline"] = {"processes": trainer.ranks, "stages": trainer.stages,
                           "schedule": trainer.schedule, "balance": trainer.balance,
                           "chunks": trainer.chunks}
    if out_dir is not None:
        outputs.write_outputs(out_dir, records, final_state, summary,
                              f"{config.run_name}: pipeline, {env.world_size} process(es)")
    return TrainResult(config, summary, state, tuple(records), model, out_dir, notes)
