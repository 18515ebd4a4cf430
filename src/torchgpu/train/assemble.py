"""A run, assembled once: every check, decision and piece before ``--out`` exists.

:func:`settle` validates and resolves the config; :func:`assemble` decides the processes,
device, precision, strategy and resume point, checks ``--out``, loads the Task and builds
the model (a launcher that starts workers builds none), and probes a model the plug-in does
not vouch for on two samples of each split. Each step runs once per process and raises a
torchgpu error for bad input, so a bad run leaves nothing behind. The one exception to the
order is ``--strategy auto``: the planner measures the data and the model, so they come
first and it decides on that very model (never built twice). The runner trains the
``Assembly`` as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchgpu.devices.cuda_status import cuda_device_count
from torchgpu.distributed import DistEnv
from torchgpu.errors import UsageError
from torchgpu.launch.run import check_process_count
from torchgpu.precision import resolve_mode
from torchgpu.train import strategies
from torchgpu.train.auto_strategy import decide_strategy
from torchgpu.train.checkpoints.resume_plan import plan_resume
from torchgpu.train.checkpoints.run_start import RunStart
from torchgpu.train.checkpoints.world_change import check_asked
from torchgpu.train.config import TrainConfig, resolve
from torchgpu.train.config_checks import validate
from torchgpu.train.guards.auto_batch import fixed_effective
from torchgpu.train.hooks.run_hooks import RunHooks
from torchgpu.train.observe.memory_snapshot import refuse_off_cuda
from torchgpu.train.out_dir import check_creatable, check_out_dir
from torchgpu.train.plugin import task_for_config, with_optimizer
from torchgpu.train.probe import probe
from torchgpu.train.schedule import check as check_schedule
from torchgpu.train.strategies import placing as build
from torchgpu.train.stream_run import check_stream
from torchgpu.train.task import Task


@dataclass(frozen=True)
class Assembly:
    """Everything a run needs, decided once (see the module docstring).

    ``config``: validated, resolved, ``--strategy auto`` replaced by the planner's pick.
    ``env``: this process's place (a launcher: rank 0 of the world it will start).
    ``nproc``: processes per node a launcher starts (1 when it trains itself).
    ``model``: the built, unwrapped model (None in a launcher that starts workers).
    ``notes``: lines for the console (device, planner, precision, fallback).
    """

    config: TrainConfig
    env: DistEnv
    nproc: int
    device: torch.device
    choice: strategies.Choice
    task: Task
    model: nn.Module | None
    out_dir: Path
    start: RunStart
    notes: tuple[str, ...] = ()
    planned: Any = None  # the planner's Plan when it ran: its estimate goes in the summary
    auto_note: str = ""  # --strategy auto's decision, one line ("" when not auto)

    @property
    def relaunch(self) -> bool:
        """True when this launcher starts workers under torchrun instead of training."""
        c = self.config
        return self.nproc > 1 or c.nnodes > 1 or c.max_restarts > 0


def settle(config: TrainConfig) -> TrainConfig:
    """``config`` validated, then resolved (defaults filled, ``--out`` named); then
    checks that ``--out`` can be created and, with ``--log tensorboard``, that
    tensorboard imports and ``OUT/tensorboard`` takes files (before any data is loaded,
    which ``--strategy auto``'s planner does first)."""
    validate(config)
    settled = resolve(config)
    assert settled.out is not None
    check_creatable(settled.out)
    if settled.log == "tensorboard":
        from torchgpu.train.observe.tensorboard import (  # imports tensorboard
            check_available,
            check_log_dir,
        )

        check_available()
        check_log_dir(settled.out)
    return settled


def check_observers(config: TrainConfig, device: torch.device) -> None:
    """Refuse, before anything is written, what the run could not observe."""
    refuse_off_cuda(config.memory_snapshot, device)


def processes_to_start(config: TrainConfig) -> int:
    """A launcher's processes per node: ``--nproc``; for ddp/fsdp without it one per
    visible GPU (CUDA not initialised); else 1."""
    if config.nproc is not None:
        return config.nproc
    several = (config.strategy != strategies.AUTO
               and strategies.get(config.strategy).processes == "several")
    if several and config.device in ("auto", "cuda") and torch.cuda.is_available():
        return max(1, cuda_device_count())
    return 1


def _check_launch(nproc: int, device: torch.device) -> None:
    """Refuse more processes than this node can hold: GPUs for CUDA, the per-core cap
    for CPU (gloo) processes."""
    if device.type == "cuda":
        count = cuda_device_count()
        if nproc > count:
            raise UsageError(
                f"--nproc {nproc} needs {nproc} GPUs on this node but {count} are visible: "
                f"use --nproc {count} or fewer, or --device cpu for {nproc} CPU processes.")
    else:
        check_process_count(nproc, "CPU processes")


def assemble(config: TrainConfig, *, task: Task | None = None, launching: bool = False,
             env: DistEnv | None = None) -> Assembly:
    """Assemble the run of ``config`` (from ``settle``); see the module docstring.

    ``task``: what to train (:func:`torchgpu.fit` passes the user's); by default the one
    ``config`` names, loaded here. ``launching``: this process may start workers (the
    CLI outside torchrun): it decides how many and builds the model only when it will
    train itself or must measure it for ``--strategy auto``. ``env``: this process's
    place (default: from torchrun's variables). The run's hooks
    (:class:`~torchgpu.train.hooks.run_hooks.RunHooks`) are taken here, once.
    """
    here = env if env is not None else DistEnv.from_env()
    model: nn.Module | None = None
    auto_notes: tuple[str, ...] = ()
    planned: Any = None
    if task is not None:  # fit's: --optimizer (optimizer="sgd") applies to it too
        task = with_optimizer(task, config)
    if config.strategy == strategies.AUTO:  # the planner measures the data and model
        task = task if task is not None else task_for_config(config)
        model = task.build_model()
        _probe(task, model, config)
        world = (config.nproc or 1) * config.nnodes if launching else here.world_size
        decision = decide_strategy(config, world, task, launching=launching, model=model)
        config, auto_notes, planned = decision.config, (decision.note,), decision.plan
    nproc = processes_to_start(config) if launching else 1
    if launching:
        here = DistEnv(rank=0, local_rank=0, world_size=nproc * config.nnodes,
                       local_world_size=nproc)
    device = build.choose_device(config, here)
    resolve_mode(config.precision, device)  # fp16 off CUDA: ConfigError, before launching
    check_observers(config, device)  # --memory-snapshot off CUDA
    relaunch = launching and (nproc > 1 or config.nnodes > 1 or config.max_restarts > 0)
    if relaunch:
        _check_launch(nproc, device)
    choice = build.choose_strategy(config, here, device)
    # --effective-batch-size with a fixed --batch-size: the accumulation, for this world
    ranks = choice.strategy.shard(here.rank, here.world_size).world_size
    asked = config.effective_batch_size
    config = fixed_effective(config, ranks)
    # ResumeError (exit 2) before anything is written; the files are hashed by one process
    plan = plan_resume(config, check_files=here.rank == 0, world=ranks,
                       strategy=choice.strategy.name)
    if plan.change is not None:  # another world size: the accumulation keeps the batch
        config = plan.change.apply(check_asked(plan.change, asked, config))
    # holds a run: refused, unless continued or (--autoresume, no checkpoint) started over
    out_dir = check_out_dir(config, resuming=plan.continuing or plan.start_over)
    if task is None:
        task = task_for_config(config)  # the data, loaded once
    if model is None and not relaunch:
        model = task.build_model()  # once (a launcher's workers build their own)
        _probe(task, model, config)
    if relaunch:  # what every worker would refuse: one message, before any starts
        choice.strategy.check_task(
            task, lambda: model if model is not None else task.build_model())
    check_schedule(config, task, model)  # a scheduler factory meets a probe optimizer
    check_stream(task, config, choice.strategy.shard(0, here.world_size).world_size)
    notes = (build.device_note(config, device), *auto_notes,
             *build.precision_notes(config, device))
    start = RunStart(plan, RunHooks.for_run(here.rank))
    return Assembly(config=config, env=here, nproc=nproc, device=device, choice=choice,
                    task=task, model=model, out_dir=out_dir, start=start,
                    notes=notes + choice.notes, planned=planned,
                    auto_note=auto_notes[0] if auto_notes else "")


def _probe(task: Task, model: nn.Module, config: TrainConfig) -> None:
    """A model its plug-in does not vouch for meets its data (both splits) and loss once
    before anything is written."""
    if task.trusted:
        return
    model_label = f"--model {config.model}" if config.model else "the model"
    data = f"--data {config.data}" if config.data else "the training data"
    held_out = f"the evaluation split of {data}" if config.data else "the evaluation data"
    if (config.data or "").startswith("fit:"):  # fit's objects, by its arguments' names
        model_label, data, held_out = "the model", "train_data", "eval_data"
    probe(task, model, model_label=model_label, data_label=data, eval_label=held_out,
          loss_label=f"--loss {config.loss}" if config.loss else None)

