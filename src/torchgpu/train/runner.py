"""``train(config)``: one run from a TrainConfig to files in ``--out``.

Order matters: everything that can fail on bad input (config values, device, data,
model, strategy) is settled and assembled once (:mod:`torchgpu.train.assemble`)
*before* the output directory is created, so a bad run leaves nothing behind; the
runner then wraps the model (the strategy's :meth:`~torchgpu.train.strategies.Strategy.wrap`)
and trains it. Only rank 0 prints and writes.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from torch import nn

from torchgpu.collectives import gather_objects
from torchgpu.data.batches import install_call_convention
from torchgpu.data.workers import forking, loader_summary
from torchgpu.errors import (
    DistributedError,
    EvaluationError,
    TorchGpuError,
    first_line,
)
from torchgpu.launch.heartbeat import Heartbeat, collective_failure
from torchgpu.launch.stop_record import StopFlag
from torchgpu.train import run_data, schedule, stream_run
from torchgpu.train.assemble import Assembly, assemble, settle
from torchgpu.train.checkpoints.autoresume import RunFinished, continue_hint
from torchgpu.train.checkpoints.finished import finished_result
from torchgpu.train.checkpoints.run_checkpoints import RunCheckpoints
from torchgpu.train.checkpoints.run_start import Ranks, RunStart
from torchgpu.train.config import TrainConfig
from torchgpu.train.fingerprints import fingerprints
from torchgpu.train.guards.agreement import share_stop
from torchgpu.train.guards.auto_batch import apply_auto_batch, batch_line
from torchgpu.train.guards.stop_deadline import StopDeadline
from torchgpu.train.loop.epoch import (
    EpochBatches,
    EpochTotals,
    agreed_steps,
    run_epoch,
    sync_now,
)
from torchgpu.train.observe.data_wait import DataWait
from torchgpu.train.observe.observers import Observers
from torchgpu.train.observe.progress import NullProgress, make_progress, memory_reader
from torchgpu.train.out_dir import clear_run
from torchgpu.train.outputs import files as outputs
from torchgpu.train.outputs.files import EpochRecord, MetricsBuffer
from torchgpu.train.outputs.final_model import final_weights
from torchgpu.train.outputs.report import (
    TrainResult,
    epoch_record,
    peak_memory,
    summary_of,
    write_config,
)
from torchgpu.train.outputs.step_log import StepLog
from torchgpu.train.plugin import task_for_config
from torchgpu.train.run_session import named_hangs, process_group
from torchgpu.train.state import TrainState
from torchgpu.train.strategies import placing as build
from torchgpu.train.strategies.run_steps import StepContext
from torchgpu.train.task import Task, spreads_inputs


def train(config: TrainConfig | None = None, *, stop: StopFlag | None = None,
          task: Task | None = None, run: Assembly | None = None) -> TrainResult:
    """Run ``config`` to the end (or until ``stop`` is set); return the result.

    Under torchrun (WORLD_SIZE set) this forms the process group (kept for the process's life,
    reused by the next ``train`` in it) and trains with the resolved strategy. ``task``: what
    to train (``fit`` passes the user's model and data; by default the one ``config`` names).
    ``run``: the run already assembled (the CLI's); without it ``config`` is settled and
    assembled here. Bad input raises torchgpu errors before anything is written, and so does
    a ``stop`` requested while the group forms (:class:`torchgpu.rendezvous.GroupStopped`)."""
    beat = Heartbeat.from_env()  # a launcher's multi-process run: where this rank is
    with beat.running() if beat is not None else nullcontext():
        if beat is not None:
            beat.phase = "startup"
        if run is None:
            assert config is not None, "train() needs a config or an assembled run"
            try:
                run = assemble(settle(config), task=task)
            except RunFinished as done:  # --autoresume: nothing to do
                return finished_result(done, task if task is not None else
                                       task_for_config(done.config))
        assert run.model is not None, "a launcher's assembly starts workers; it does not train"
        model = run.model
        with named_hangs(run, beat), process_group(run, beat, stop) as session:
            # dict or tuple inputs: model(**batch) / model(*inputs), for this run only
            convention = install_call_convention(model) if spreads_inputs(run.task) else None
            try:
                # the strategy wraps the model, --batch-size auto settles the batch: then train
                env, device, choice = run.env, run.device, run.choice
                model, wrap_notes = build.wrap_model(model, choice, run.config, run.task,
                                                     device)
                config, batch_note = apply_auto_batch(run.config, model, run.task, device,
                                                      env.world_size, run.start.hooks)
                notes = run.notes + wrap_notes + ((batch_note,) if batch_note else ())
                out_dir = run.out_dir if env.is_main else None  # only rank 0 writes
                return _Run(run, config, model, notes, stop or StopFlag(), out_dir,
                            agree=session.is_distributed, beat=beat).train()
            finally:
                if convention is not None:
                    convention.remove()


class _Run:
    """One run, the same for every strategy; what differs comes from the strategy's steps
    (:mod:`torchgpu.train.strategies.run_steps`). The constructor sets it up (loaders, the
    strategy's steps, the schedule, ``--out``, the checkpoints and the state, observers);
    :meth:`train` runs the epochs and writes the outputs."""

    def __init__(self, run: Assembly, config: TrainConfig, model: nn.Module,
                 notes: tuple[str, ...], stop: StopFlag, out_dir: Path | None, *,
                 agree: bool, beat: Heartbeat | None) -> None:
        from torchgpu.precision import Precision

        assert config.batch_size is not None and config.epochs is not None
        rank, world, device = run.env.rank, run.env.world_size, run.device
        strategy, data, start = run.choice.strategy, run.task, run.start
        self.run, self.device, self.world, self.agree = run, device, world, agree
        self.stop, self.beat, self.out_dir, self.is_main = stop, beat, out_dir, out_dir is not None
        self.precision = Precision(config.precision, device)
        shard = strategy.shard(rank, world)
        self.train_loader, self.test_loader = run_data.loaders(data, config, shard, device)
        steps = self.steps = strategy.steps(StepContext(
            config=config, rank=rank, world=world, agree=agree, device=device, task=data,
            model=model, precision=self.precision, stop=stop, out_dir=out_dir,
            heartbeat=beat, hooks=start.hooks, position=lambda: (state.step, state.epoch),
            layout=stream_run.layout_of(self.train_loader), resume_from=start.plan.source))
        config = self.config = steps.config
        parts = self.parts = steps.parts
        assert config.epochs is not None
        self.batches_per_epoch = len(self.train_loader)
        scheduler = schedule.for_run(config, data, steps.optimizer,
                                     math.ceil(self.batches_per_epoch / config.accumulate),
                                     warn=self.is_main)
        self.progress = (NullProgress() if config.json else make_progress(
            config.progress, is_main=self.is_main, memory=memory_reader(device)))
        if out_dir is not None:
            if world > 1:  # what a process's batch_size means here: the global batch first
                notes = (batch_line(config, shard.world_size), *notes)
            notes = _open_out_dir(out_dir, config, start, notes)
            for note in (*notes, *steps.lines()):
                print(note, file=sys.stderr)
        self.notes = notes
        self.buffer = MetricsBuffer()
        self.streamed = stream_run.StreamReport(self.train_loader, is_main=self.is_main)
        self.records: list[EpochRecord] = []
        self.waits = DataWait(self.train_loader.num_workers, config.num_workers)
        self.files = fingerprints(config) if self.is_main else {}  # hashed once, cached
        ckpt = self.ckpt = RunCheckpoints(
            config, model=steps.model, optimizer=steps.optimizer, precision=self.precision,
            ranks=Ranks(rank, world), records=self.records, stop=steps.stop,
            batches_per_epoch=self.batches_per_epoch, mode=strategy.name, out_dir=out_dir,
            sync=(lambda: sync_now(parts)) if parts.agree else None, heartbeat=beat,
            before_save=steps.before_save, scheduler=scheduler, files=self.files,
            data=stream_run.position_of(self.train_loader),
            # one process of --strategy fsdp trains as single but writes shards too, so
            # that more processes can continue its run
            sharded=(strategy.features.sharded_checkpoints and world > 1)
            or config.strategy == "fsdp")
        state = self.state = ckpt.begin(start.plan)  # fresh, or restored from a checkpoint
        self.buffer.lrs = state.step_lrs
        if out_dir is not None:  # after the resume's checks: a refused resume changes nothing
            write_config(out_dir, config, world, device, steps.model, self.files)
        if beat is not None:
            beat.follow(state)
            beat.phase = steps.phase
        steps_left = (math.ceil(self.batches_per_epoch / config.accumulate) * config.epochs
                      - state.step)
        self.watch = Observers.start(config, steps.observed, device, rank, out_dir, state,
                                     steps_left)
        # The schedule steps (and the step's LR is recorded) before a checkpoint is saved;
        # the run's hooks come after the checkpoint; the step records go on disk as they come.
        on_step = self.watch.wrap(schedule.step_hook(
            steps.optimizer, scheduler,
            start.hooks.after_step(ckpt.step_hook(), steps.stop, ckpt.sync)))
        self.on_step = StepLog(out_dir, self.buffer, config.log_every,
                               lambda: agreed_steps(parts)).wrap(on_step)
        # Where the loop may read the losses a step late (no sync per step): every step's
        # on_step then runs at the next step's start, except where a checkpoint is due.
        # Not with the run's hooks (a step limit must stop at its step) nor profiling
        # (its steps are the loop's).
        self.settle = (ckpt.saves_at if not start.hooks.hooks and self.watch.profiler is None
                       else None)
        self.train_seconds = 0.0
        self.started = 0.0  # train()'s start: the summary's wall time runs to its end
        self.stopped_at: int | None = None  # the step the loop stopped at on a stop flag

    def train(self) -> TrainResult:
        """The epochs: each one trained (:func:`run_epoch`), then evaluated, recorded and
        flushed to ``--out``; a stop ends the run at a step boundary, saved."""
        config, state, steps, ckpt, beat = self.config, self.state, self.steps, self.ckpt, self.beat
        assert config.epochs is not None
        self.started = time.perf_counter()
        self.progress.start(config.epochs, self.batches_per_epoch, state.epoch)
        starts = run_data.EpochStarts(self.train_loader, config.seed, config.epochs,
                                      ckpt.start_epoch)
        try:
            deadline = StopDeadline(self.stop, config.stop_timeout, ckpt.saving,
                                    lambda: ckpt.last_saved)
            with self.stop.installed(), deadline.watching():
                for epoch in range(state.epoch, config.epochs):
                    if state.batch_in_epoch == 0 or state.epoch != epoch:
                        state.begin_epoch(epoch)
                    batches = starts.begin(epoch, state.batch_in_epoch)
                    start_next = starts.ahead_of(epoch + 1)
                    fetched: Iterator[Any] = batches
                    if self.device.type == "cuda":  # copies overlap compute on a side stream
                        from torchgpu.transfer import Prefetcher

                        fetched = iter(Prefetcher(batches, self.device))
                    if beat is not None:  # a rank waiting for its data is named as such
                        fetched = beat.loading(fetched)
                    try:
                        totals = run_epoch(self.parts, fetched, state,
                                           batches_per_epoch=self.batches_per_epoch,
                                           stop=steps.stop, on_step=self.on_step,
                                           progress=self.progress, records=self.buffer.steps,
                                           settle=self.settle, ahead=start_next,
                                           ahead_left=starts.in_flight)
                    finally:
                        batches.close()  # the epoch's DataLoader workers end here, error or not
                    if self._stopped(epoch, totals, deadline):
                        break
                    if start_next is not None:  # an epoch shorter than the workers' queues
                        start_next()
                    self._evaluate(epoch, totals)
        finally:
            starts.close()
            self.progress.close()
            self.watch.close(state)
        return self._finish()

    def _stopped(self, epoch: int, totals: EpochTotals, deadline: StopDeadline) -> bool:
        """After epoch ``epoch``'s training: its data wait, then whether a stop ends the
        run here (saved, with how to resume)."""
        config, state, steps = self.config, self.state, self.steps
        self.train_seconds += totals.seconds
        slow_data = self.waits.add(epoch, totals.data_wait_s, totals.seconds,
                                   totals.first_wait_s)
        if slow_data and self.is_main:
            print(slow_data, file=sys.stderr)
        if not totals.stopped:
            self.streamed.epoch_end(epoch, state.batch_in_epoch, self.batches_per_epoch,
                                    config.accumulate)
            return False
        deadline.reached()  # at a step boundary: the stop's save is not cut short
        assert config.epochs is not None
        if epoch == config.epochs - 1 and state.batch_in_epoch >= self.batches_per_epoch:
            return False  # a stop agreed after the run's last step stops nothing: it finishes
        self.stopped_at = state.step
        if self.agree and steps.stop.steps_by_rank is None:
            # every rank stops here: agree on why and where (names the rank)
            share_stop(steps.stop, state.step)
        self.watch.steps(self.buffer.steps)
        self.ckpt.stopped(state, self.buffer, self.batches_per_epoch)  # save, say how to resume
        return True

    def _evaluated(self) -> Any:
        """The strategy's evaluation of the held-out split; its DataLoader workers, if
        any, end when it does, even on an error (whose traceback holds the iterator)."""
        loader = self.test_loader
        if not getattr(loader, "num_workers", 0):
            return self.steps.evaluate(loader)
        with forking():
            batches = EpochBatches(iter(loader))
        try:
            return self.steps.evaluate(batches)
        finally:
            batches.close()

    def _evaluate(self, epoch: int, totals: EpochTotals) -> None:
        """The epoch's evaluation and record (metrics.jsonl, observers, progress)."""
        state, beat, config = self.state, self.beat, self.config
        assert config.epochs is not None
        with beat.during("evaluation") if beat is not None else nullcontext():
            try:
                result = self._evaluated()
            except Exception as error:
                if isinstance(error, DistributedError) or collective_failure(error):
                    raise  # a peer's failure: no collective save can follow
                self.watch.steps(self.buffer.steps)
                raise _evaluation_failed(self.ckpt, state, self.buffer, self.out_dir,
                                         config, error) from error
        record = epoch_record(state, result, totals.samples, totals.seconds,
                              self.steps.record_world)
        self.records.append(record)
        state.epoch_losses.append((record.train_loss, record.test_loss))
        state.begin_epoch(epoch + 1)
        self.watch.epoch(self.buffer.steps, record)
        if self.out_dir is not None:
            outputs.flush_epoch(self.out_dir, self.buffer, record)
        self.progress.end_epoch(record, config.epochs, data_wait=totals.data_wait_share)

    def _finish(self) -> TrainResult:
        """The final weights, the summary and the run's files (rank 0)."""
        config, state, steps, ckpt, device = (self.config, self.state, self.steps, self.ckpt,
                                              self.device)
        run, mode, world, out_dir = self.run, self.run.choice.strategy.name, self.world, \
            self.out_dir
        if self.beat is not None:
            self.beat.phase = "finishing"
        ckpt.finish()  # a checkpoint still being written (--async-save) is committed first
        self.parts.accumulator.zero_grad()  # the model handed back holds no gradients
        assert config.out is not None  # settled: every run has its --out
        final_state = final_weights(steps.model, ckpt.shards, Path(config.out), state,
                                    steps.full_state)
        ckpt.close()
        peaks = gather_objects((str(device), build.device_name(device), peak_memory(device)))
        summary = summary_of(config, run.task, mode, world, state, self.records, peaks,
                             self.train_seconds, time.perf_counter() - self.started,
                             steps.stop, self.precision.mode,
                             self.stopped_at)
        summary.update(ckpt.summary())
        summary.update(self.waits.summary())
        summary["data_loader"] = loader_summary(self.train_loader, config.num_workers)
        summary["fingerprints"] = self.files
        summary.update(self.streamed.summary())
        steps.summarize(summary, state, self.train_seconds)
        if out_dir is not None:
            self.watch.report(summary, config, run.planned, run.task, mode, world)
            outputs.write_outputs(out_dir, self.records, final_state, summary,
                                  f"{config.run_name}: {mode}, {world} process(es)",
                                  state.step_lrs)
        return TrainResult(config, summary, state, tuple(self.records), steps.result_model,
                           out_dir, self.notes)


def _open_out_dir(out_dir: Path, config: TrainConfig, start: RunStart,
                  notes: tuple[str, ...]) -> tuple[str, ...]:
    """``--out`` made ready for this run: ``--overwrite`` (a fresh run) or ``--autoresume``
    without a checkpoint clears the previous run's files; the notes, with what was removed."""
    if config.overwrite and not start.plan.continuing:  # checked in assemble
        removed = clear_run(out_dir)
        if removed:
            notes += (f"note: --overwrite: removed the previous run's {', '.join(removed)} "
                      f"from {out_dir}",)
    elif start.plan.start_over:  # --autoresume without a checkpoint: its note says so
        clear_run(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return notes


def _evaluation_failed(ckpt: RunCheckpoints, state: TrainState, buffer: MetricsBuffer,
                       out_dir: Path | None, config: TrainConfig, error: Exception
                       ) -> EvaluationError:
    """The evaluation after an epoch raised ``error``: keep the epoch's training (a
    checkpoint of its end, unless one of that step exists, saved by every rank; its step
    losses appended to metrics.jsonl by rank 0) and return the error naming the
    evaluation, where the epoch is kept and how to continue (the resumed run evaluates
    that epoch again)."""
    kept = ""
    try:
        if ckpt.last_saved_step != state.step:
            ckpt.save(state)
        ckpt.finish()  # an --async-save of this step may still be written
        kept = f"its checkpoint is {ckpt.last_saved}"
    except TorchGpuError as save_error:  # the evaluation's error stays the one raised
        kept = f"saving its checkpoint failed too ({first_line(save_error)})"
    if out_dir is not None:
        outputs.append_lines(out_dir / outputs.METRICS_FILE, buffer.take_lines())
        kept += f", its step losses are in {out_dir / outputs.METRICS_FILE}"
    how = continue_hint(config)
    return EvaluationError(
        f"the evaluation after epoch {state.epoch + 1} of {config.epochs} (step "
        f"{state.step}) failed: {first_line(error)}. The epoch's training is kept: {kept}. "
        "Fix what failed (a metric, the loss on the evaluation split, or the evaluation "
        f"data), then {how}: the run evaluates that epoch again and goes on."
    )
