"""``train(config)``: one run from a TrainConfig to files in ``--out``.

Order matters: everything that can fail on bad input (config values, device, data,
model, strategy wrapper) runs *before* the output directory is created, so a bad run
leaves nothing behind. Only rank 0 prints and writes.
"""

from __future__ import annotations

import dataclasses
import math
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchgpu.data.batches import install_call_convention
from torchgpu.errors import UsageError
from torchgpu.train import build, metrics
from torchgpu.train.agreement import RankAgreement
from torchgpu.train.backoff import for_run as backoff_for_run
from torchgpu.train.checkpointing import Ranks, RunCheckpoints, RunStart, plan_resume
from torchgpu.train.config import TrainConfig, resolve, validate
from torchgpu.train.loop import EvalResult, LoopParts, evaluate, run_epoch
from torchgpu.train.metrics import EpochRecord, MetricsBuffer
from torchgpu.train.observers import Observers
from torchgpu.train.progress import NullProgress, make_progress
from torchgpu.train.state import StopFlag, TrainState
from torchgpu.train.task import Task, spreads_inputs, task_for_config

if TYPE_CHECKING:
    from torchgpu.distributed import DistEnv


@dataclass(frozen=True)
class Shard:
    """This rank's slice of the training order (``make_loader``'s ``dist`` argument).

    Always "distributed", even for one process, so the order of epoch ``e`` is the same
    permutation ``randperm(n, seed + e)`` for every world size: the global batch of a
    DDP run holds exactly the samples of the one-process run with the global batch.
    The shard is unpadded (``make_loader(pad=False)``, :mod:`torchgpu.data.shards`):
    when the training set does not split evenly, ranks hold different numbers of the
    last batch's samples (possibly none), and the loop weights each rank's loss by its
    samples (:mod:`torchgpu.train.tail`), so DDP trains the one-process weights
    (to float rounding) for every dataset size, not only for multiples of the world.
    """

    rank: int
    world_size: int
    is_distributed: bool = True


@dataclass(frozen=True)
class TrainResult:
    """What a run produced. ``model`` is the trained, unwrapped model (on its device)."""

    config: TrainConfig
    summary: dict[str, Any]
    state: TrainState
    epochs: tuple[EpochRecord, ...]
    model: nn.Module
    out_dir: Path | None  # None on ranks other than 0
    notes: tuple[str, ...] = field(default=())

    @property
    def final(self) -> EpochRecord | None:
        return self.epochs[-1] if self.epochs else None


def check_out_dir(out: str, resuming: bool) -> Path:
    """Refuse an ``--out`` that is a file or already holds a run (unless resuming)."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise UsageError(
            f"--out {out} exists and is not a directory: pass a new directory for the run."
        )
    if not resuming and path.is_dir():
        taken = [n for n in (metrics.SUMMARY_FILE, metrics.METRICS_FILE) if (path / n).exists()]
        if taken:
            raise UsageError(
                f"--out {out} already holds a run ({', '.join(taken)}): pass a new --out "
                "directory, delete the old run, or continue it with --resume."
            )
    return path


def _peak_memory(device: torch.device) -> int:  # bytes
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    # ru_maxrss is KiB on Linux, bytes on macOS: the process's peak resident memory.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _memory_reader(device: torch.device) -> Any:
    if device.type != "cuda":  # the CPU's memory is the process's (model, data, activations)
        from torchgpu.train.progress import read_process_rss

        return read_process_rss

    def read() -> str:
        return f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB"

    return read


def _gather(value: Any, distributed: bool) -> list[Any]:
    if not distributed:
        return [value]
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _final_state(model: nn.Module, mode: str) -> dict[str, torch.Tensor]:
    """The full model state with canonical keys (collective under fsdp: call on all ranks)."""
    from torchgpu.parallel.data import unwrap

    if mode == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state: dict[str, Any] = dict(get_model_state_dict(model, options=options))
    else:
        state = unwrap(model).state_dict()
    # Left on their device: the writer finds tied weights by storage before copying.
    return {k: v.detach() for k, v in state.items() if isinstance(v, torch.Tensor)}


def train(config: TrainConfig, *, stop: StopFlag | None = None,
          stop_at_step: int | None = None, task: Task | None = None) -> TrainResult:
    """Run ``config`` to the end (or until ``stop`` is set); return the result.

    ``stop_at_step``: stop (and checkpoint) after that optimizer step, as if the stop
    flag were set then. Checkpointing and resume: :mod:`torchgpu.train.checkpointing`.

    Under torchrun (WORLD_SIZE set) this forms the process group, trains with the
    resolved strategy and destroys the group. Raises torchgpu errors for bad input
    before anything is written.

    ``task``: what to train (:func:`torchgpu.fit` passes the user's model and data);
    by default the one ``config`` names (:func:`~torchgpu.train.task.task_for_config`),
    whose data is loaded once, here, before ``--out`` is created.
    """
    validate(config)
    config = resolve(config)
    from torchgpu.train.out_dir import check_creatable

    assert config.out is not None
    check_creatable(config.out)  # before the data is loaded: a bad --out fails at once
    if task is None:
        task = task_for_config(config)
    from torchgpu.distributed import DistEnv, init_distributed

    env = DistEnv.from_env()
    auto_notes: tuple[str, ...] = ()
    planned: Any = None  # the planner's Plan when it ran: its estimate goes in the summary
    if config.strategy == "auto":  # the planner decides (torchgpu.train.auto_strategy)
        from torchgpu.train.auto_strategy import decide_strategy

        decision = decide_strategy(config, env.world_size, task)
        config, auto_notes = decision.config, (decision.note,)
        planned = decision.plan
    from torchgpu.train.auto_batch import simulated_limit

    memory_limit = simulated_limit(env.rank)  # test-only simulated memory, read once
    device = build.choose_device(config, env)
    _check_observers(config, device)  # --memory-snapshot off CUDA, --log without tensorboard
    auto_notes = (build.device_note(config, device), *auto_notes)
    auto_notes += build.precision_notes(config, device)
    choice = build.choose_strategy(config, env, device)
    assert config.out is not None
    from torchgpu.train.faults import crash_plan_from_env

    plan = plan_resume(config)  # ResumeError (exit 2) before anything is written
    crash = crash_plan_from_env(env.rank)  # test-only fault injection, read once
    out_dir = check_out_dir(config.out, resuming=plan.continuing)
    data = task
    with init_distributed(device=device) as session:
        agree = session.is_distributed
        model = task.build_model()
        # dict or tuple inputs: model(**batch) / model(*inputs), for this run only
        convention = install_call_convention(model) if spreads_inputs(task) else None
        try:
            return _assembled(config, env, agree, device, choice, data, model, out_dir,
                              auto_notes, memory_limit, stop or StopFlag(),
                              RunStart(plan, crash, stop_at_step), planned)
        finally:
            if convention is not None:
                convention.remove()


def _assembled(config: TrainConfig, env: DistEnv, agree: bool, device: torch.device,
               choice: build.StrategyChoice, data: Task, model: nn.Module, out_dir: Path,
               auto_notes: tuple[str, ...], memory_limit: int | None, stop: StopFlag,
               start: RunStart, planned: Any = None) -> TrainResult:
    """The run, once device, strategy, data and model exist: wrap, batch size, train."""
    if choice.mode == "pipeline" and env.world_size > 1:  # one stage per process
        from torchgpu.train.stage_strategy import train_stages

        staged = train_stages(config, env, device, data, model,
                              out_dir if env.is_main else None, auto_notes + choice.notes,
                              stop)
        if staged.out_dir is not None:
            _write_config(staged.out_dir, staged.config, env.world_size, device)
        return staged
    model, wrap_notes = build.wrap_model(model, choice, config, data, device)
    from torchgpu.train.auto_batch import apply_auto_batch

    config, batch_note = apply_auto_batch(config, model, data, device, env.world_size,
                                          memory_limit)
    notes = auto_notes + choice.notes + wrap_notes + ((batch_note,) if batch_note else ())
    return _run(config, env.rank, env.world_size, agree, device, choice.mode, data,
                model, out_dir if env.is_main else None, notes, stop, start, planned)


def _run(
    config: TrainConfig,
    rank: int,
    world: int,
    agree: bool,
    device: torch.device,
    mode: str,
    data: Any,
    model: nn.Module,
    out_dir: Path | None,
    notes: tuple[str, ...],
    stop: StopFlag,
    start: RunStart | None = None,
    planned: Any = None,
) -> TrainResult:
    from torchgpu.accumulate import GradAccumulator
    from torchgpu.data import make_loader
    from torchgpu.parallel.data import unwrap
    from torchgpu.precision import Precision
    from torchgpu.transfer import Prefetcher

    assert config.batch_size is not None and config.epochs is not None and config.lr is not None
    precision = Precision(config.precision, device)
    optimizer = data.make_optimizer(model, config.lr)
    acc = GradAccumulator(model, optimizer, config.accumulate, precision=precision,
                          clip_norm=config.clip_norm)
    train_loader = make_loader(data.train, config.batch_size, shuffle=True, seed=config.seed,
                               dist=Shard(rank, world), device=device,
                               num_workers=config.num_workers, pad=False,
                               dict_pairs=data.dict_batches)
    test_loader: Any = (make_loader(data.test, max(config.batch_size, 256) if data.kind != "custom"
                               else config.batch_size, shuffle=False, device=device,
                               dict_pairs=data.dict_batches)
                   if data.test is not None else [])
    loss_fn = data.loss
    from torchgpu.train.split_strategies import output_device

    target_device = output_device(model)  # model/pipeline: labels meet the output there
    if target_device == device:
        target_device = None
    parts = LoopParts(model=model, loss_fn=loss_fn, accumulator=acc, precision=precision,
                      device=device, accumulate=config.accumulate,
                      move_batches=device.type not in ("cpu", "cuda"),
                      on_nonfinite=config.on_nonfinite, rank=rank, agree=agree,
                      target_device=target_device,
                      backoff=backoff_for_run(mode, model, acc, loss_fn, precision,
                                              batch_size=config.batch_size,
                                              accumulate=config.accumulate, device=device,
                                              distributed=agree, out_dir=out_dir,
                                              position=lambda: (state.step, state.epoch)),
                      agreement=RankAgreement(world) if agree else None,
                      layout=getattr(train_loader.batch_sampler, "layout", None))
    is_main = out_dir is not None
    progress = (NullProgress() if config.json else
                make_progress(config.progress, is_main=is_main, memory=_memory_reader(device)))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        for note in notes:
            print(note, file=sys.stderr)
        _write_config(out_dir, config, world, device)
    buffer = MetricsBuffer()
    batches_per_epoch = len(train_loader)
    eval_model = unwrap(model) if mode != "fsdp" else model
    records: list[EpochRecord] = []
    start = start or RunStart()
    ckpt = RunCheckpoints(config, model=model, optimizer=optimizer, precision=precision,
                          ranks=Ranks(rank, world), records=records, stop=stop,
                          batches_per_epoch=batches_per_epoch, mode=mode, out_dir=out_dir,
                          crash=start.crash, stop_at_step=start.stop_at_step)
    state = ckpt.begin(start.plan)  # fresh, or restored from a checkpoint
    on_step = ckpt.step_hook()
    steps_left = math.ceil(batches_per_epoch / config.accumulate) * config.epochs - state.step
    watch = Observers.start(config, model, device, rank, out_dir, state, steps_left)
    on_step = watch.wrap(on_step)
    train_seconds = 0.0
    stopped_at: int | None = None  # the step the loop stopped at on a stop flag
    started = time.perf_counter()
    progress.start(config.epochs, batches_per_epoch, state.epoch)
    try:
        with stop.installed():
            for epoch in range(state.epoch, config.epochs):
                if state.batch_in_epoch == 0 or state.epoch != epoch:
                    state.begin_epoch(epoch)
                batches = ckpt.start_epoch(train_loader, config.seed, epoch,
                                           state.batch_in_epoch)
                if device.type == "cuda":  # copies overlap compute on a side stream
                    batches = iter(Prefetcher(batches, device))
                totals = run_epoch(parts, batches, state, batches_per_epoch=batches_per_epoch,
                                   stop=stop, on_step=on_step, progress=progress,
                                   records=buffer.steps)
                train_seconds += totals.seconds
                if totals.stopped:
                    stopped_at = state.step
                    watch.steps(buffer.steps)
                    ckpt.stopped(state, buffer, batches_per_epoch)  # save, say how to resume
                    break
                result = evaluate(eval_model, test_loader, loss_fn, task=data.kind,
                                  device=device, precision=precision,
                                  target_device=target_device, metrics=data.metrics)
                record = _epoch_record(state, result, totals.samples, totals.seconds, world)
                records.append(record)
                state.epoch_losses.append((record.train_loss, record.test_loss))
                state.begin_epoch(epoch + 1)
                watch.epoch(buffer.steps, record)
                if out_dir is not None:
                    metrics.flush_epoch(out_dir, buffer, record)
                progress.end_epoch(record, config.epochs)
    finally:
        progress.close()
        watch.close(state)
    final_state = _final_state(model, mode)
    peaks = _gather((str(device), build.device_name(device), _peak_memory(device)), agree)
    summary = _summary(config, data, mode, world, state, records, peaks, train_seconds,
                       time.perf_counter() - started, stop, precision.mode, stopped_at)
    summary.update(ckpt.summary())
    if parts.backoff is not None:
        summary["oom_backoffs"] = [event.as_dict() for event in parts.backoff.events]
    if out_dir is not None:
        watch.report(summary, config, planned, data, mode, world)
    if out_dir is not None:
        metrics.write_outputs(out_dir, records, final_state, summary,
                              f"{config.run_name}: {mode}, {world} process(es)")
    return TrainResult(config, summary, state, tuple(records), unwrap(model), out_dir, notes)


def _check_observers(config: TrainConfig, device: torch.device) -> None:
    """Refuse, before anything is written, what the run could not observe."""
    from torchgpu.train.memory_snapshot import refuse_off_cuda

    refuse_off_cuda(config.memory_snapshot, device)
    if config.log == "tensorboard":
        from torchgpu.train.tblog import check_available

        check_available()


def _write_config(out_dir: Path, config: TrainConfig, world: int, device: torch.device) -> None:
    from torchgpu.train.config_file import write_config

    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    write_config(out_dir, config, world_size=world, local_world_size=local, device=str(device))


def _epoch_record(state: TrainState, result: EvalResult, samples: int, seconds: float,
                  world: int) -> EpochRecord:
    train_loss = state.epoch_loss_sum / state.epoch_loss_count if state.epoch_loss_count else (
        math.nan)
    return EpochRecord(
        epoch=state.epoch, step=state.step, train_loss=train_loss, test_loss=result.loss,
        test_r2=result.r2, test_accuracy=result.accuracy,
        samples_per_s=samples * world / seconds if seconds > 0 else math.nan, seconds=seconds,
        metrics=result.metrics,
    )


def _summary(config: TrainConfig, data: Any, mode: str, world: int, state: TrainState,
             records: list[EpochRecord], peaks: list[Any], train_seconds: float,
             wall_seconds: float, stop: StopFlag, precision_mode: str,
             stopped_at: int | None = -1) -> dict[str, Any]:
    """The run's summary.json. ``stopped_at``: the step the loop stopped at on the stop
    flag, None when it ran to the end (a signal after the last step stops nothing);
    -1 (the default): judge by the flag alone."""
    stopped = stop.is_set() if stopped_at == -1 else stopped_at is not None
    final = records[-1] if records else None
    assert config.batch_size is not None
    final_metrics: dict[str, Any] = {
        "train_loss": final.train_loss if final else None,
        "test_loss": final.test_loss if final else None,
    }
    if data.kind == "regression":
        final_metrics["test_r2"] = final.test_r2 if final else None
    elif data.kind == "classification":
        final_metrics["test_accuracy"] = final.test_accuracy if final else None
    for name in data.metrics:
        final_metrics[f"test_{name}"] = final.metrics.get(name) if final else None
    samples_all = state.samples * world
    return {
        "run": config.run_name,
        "task": data.kind,
        "strategy": mode,
        "world_size": world,
        "precision": precision_mode,
        "accumulate": config.accumulate,
        "activation_checkpointing": config.activation_checkpointing,
        "epochs": len(records),
        "steps": state.step,
        "skipped_steps": state.skipped_steps,
        "batch_size": config.batch_size,
        "global_batch": config.batch_size * world * config.accumulate,
        "lr": config.lr,
        "seed": config.seed,
        "final": final_metrics,
        "throughput_samples_per_s": samples_all / train_seconds if train_seconds else None,
        "train_seconds": train_seconds,
        "wall_seconds": wall_seconds,
        "stopped_early": stopped,
        "stop_reason": stop.signal_name if stopped else None,
        "stopped_at_step": state.step if stopped else None,
        # Under DDP, every rank's step at the agreed stop (all equal: one boundary).
        "stop_steps_by_rank": (stop.steps_by_rank or [state.step]) if stopped else None,
        "devices": [{"rank": r, "device": d, "name": n, "peak_memory_bytes": b}
                    for r, (d, n, b) in enumerate(peaks)],
        "versions": metrics.versions(),
        "config": {k: v for k, v in dataclasses.asdict(config).items()},
    }
