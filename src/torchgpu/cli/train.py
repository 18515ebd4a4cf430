"""``torchgpu train``: train a built-in example or a CSV table on whatever devices exist.

Validates everything first (flags, device, data, ``--out``), then either trains in
this process or, with ``--nproc N`` / ``--nnodes`` / ``--max-restarts``, relaunches
itself under torchrun (one process per GPU, or N gloo processes on CPU). Prints where
the plot, metrics and model are; ``--json`` prints the summary JSON instead.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import TYPE_CHECKING

from torchgpu.cli.train_flags import parse_train_flags
from torchgpu.train.config import (
    TrainConfig,
)

if TYPE_CHECKING:
    from torchgpu.launch.stop_record import StopFlag
    from torchgpu.train.assemble import Assembly


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def _check_gpus(config: TrainConfig) -> None:
    """After ``--gpus`` set CUDA_VISIBLE_DEVICES: refuse (exit 2) when it leaves no GPU,
    or fewer than it names, instead of training on the CPU unasked. (Ordinals past the
    last GPU are refused earlier when NVML can count the GPUs.) ``--device cpu`` asks
    for the CPU: nothing to check. Never initialises CUDA."""
    if config.gpus is None or config.device == "cpu":
        return
    from torchgpu.devices import cuda_status
    from torchgpu.errors import VisibleDevicesError

    reason = cuda_status.cuda_unavailable_reason()
    if reason:
        raise VisibleDevicesError(
            f"--gpus {_shown(config.gpus)} was given but no GPU is visible to this process: "
            f"{reason}. Drop --gpus, or pass --device cpu to train on the CPU."
        )
    named = [t.strip() for t in config.gpus.split(",") if t.strip()]
    count = cuda_status.cuda_device_count()
    if count < len(named):
        exist = ", ".join(named[:count]) or "none"
        raise VisibleDevicesError(
            f"--gpus {_shown(config.gpus)} names {len(named)} GPUs but the driver sees only "
            f"{count} of them (it stops at the first id it lacks): {exist} exist, "
            f"{named[count]} does not. Run `torchgpu devices` to list this machine's GPUs "
            "and pass only those ids."
        )


def _relaunch(config: TrainConfig, nproc: int, on_cuda: bool) -> int:
    from torchgpu.launch.run import DEFAULT_STOP_TIMEOUT_S, LaunchSpec, run

    spec = LaunchSpec(
        nproc=nproc, nnodes=config.nnodes, node_rank=config.node_rank,
        rdzv_endpoint=config.rdzv_endpoint, max_restarts=config.max_restarts, module=True,
        # the workers end a stop themselves within --stop-timeout, then save: the
        # launcher kills only what is still running well after that
        stop_timeout_s=max(DEFAULT_STOP_TIMEOUT_S, config.stop_timeout + 30.0),
        dump_dir=os.path.join(config.out, "flight_recorder") if config.out else None,
        flight_recorder=on_cuda, torchgpu_workers=True, rdzv_timeout_s=config.rdzv_timeout,
    )
    return run(spec, "torchgpu", ["train", *worker_argv(config)])


_LAUNCH_ONLY = frozenset({"nproc", "nnodes", "node_rank", "rdzv_endpoint", "rdzv_timeout",
                          "max_restarts", "gpus"})


def worker_argv(config: TrainConfig) -> list[str]:
    """The flags a worker gets: the resolved config (so every worker writes to the same
    --out and uses the same defaults) minus what only the launcher reads."""
    argv: list[str] = []
    for f in dataclasses.fields(TrainConfig):
        value = getattr(config, f.name)
        if f.name in _LAUNCH_ONLY or value is None or value is False:
            continue
        flag = "--" + f.name.replace("_", "-")
        if value is True or (f.name == "resume" and value == ""):
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv


def _report(summary: dict[str, object]) -> str:
    final = summary.get("final") or {}
    assert isinstance(final, dict)
    bits = [f"{k} {v:.4g}" for k, v in final.items() if isinstance(v, float)]
    files = summary.get("files") or {}
    assert isinstance(files, dict)
    lines = [
        f"trained {summary['run']} ({summary['strategy']}, {summary['world_size']} "
        f"process(es), {summary['epochs']} epochs, {summary['steps']} steps): " + ", ".join(bits),
    ]
    for label in ("plot", "metrics", "summary", "model", "config", "profile", "tensorboard"):
        if files.get(label):
            lines.append(f"  {label + ':':{max(9, len(label) + 2)}s}{files[label]}")
    if summary.get("stopped_early"):
        lines.append(f"  stopped early ({summary.get('stop_reason')}) at step {summary['steps']}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """``torchgpu train [flags]``; returns the exit code (2 for bad input)."""
    config, from_file = parse_train_flags(argv)
    from torchgpu.cli import signals
    from torchgpu.launch.stop_record import StopFlag
    from torchgpu.train.runner import train

    stop = StopFlag()
    if _under_torchrun():  # a worker: the launcher checked everything; train() assembles
        from torchgpu.rendezvous import GroupStopped

        early = signals.received()  # a stop while this worker was starting
        if early is not None:
            stop.set(early.name)
        try:
            # The flag stays this process's handler to its exit: a signal during the
            # teardown of a finished run must not kill the worker (torchrun would count
            # that a failure, and with --max-restarts train the run again).
            with stop.installed():
                result = train(config, stop=stop)
                code = _finish(config, result.summary, result.out_dir is not None)
        except GroupStopped:
            code = _stopped_before_start(stop)
        _exit_worker(code)
        return code
    from torchgpu.errors import TorchGpuError
    from torchgpu.train.assemble import assemble, settle
    from torchgpu.train.checkpoints.autoresume import RunFinished
    from torchgpu.train.out_dir import OutHoldsRun

    try:
        config = settle(config)  # validated, resolved, --out creatable: before any data
        if from_file is not None:  # a replay: say which of its files changed since
            for line in from_file.changed_lines(config):
                print(line, file=sys.stderr)
        if config.gpus is not None:
            _set_gpus(config)
        # Data, model (when this process trains or plans), decisions: each once, here.
        run = assemble(config, launching=True)
        _check_step_fits(run)
    except RunFinished as done:  # --autoresume: nothing to do, the run's report again
        print(f"note: {done}", file=sys.stderr)
        return _finish(config, done.summary, True)
    except TorchGpuError as error:
        if isinstance(error, OutHoldsRun):  # the exact commands: this one + --resume...
            error.name_command(["torchgpu", "train", *argv])
        elif from_file is not None:  # a value from the file is named as its line there
            from_file.name_keys(error)
        raise
    if run.relaunch:
        launched, nproc, example = run.config, run.nproc, run.task.example
        on_cuda = run.device.type == "cuda"
        if run.auto_note:
            print(run.auto_note, file=sys.stderr)
        del run  # the workers hold the data now; free it in the launcher
        from torchgpu.examples.table import data_handoff

        # The workers load the data parsed here instead of parsing the CSV again; a stop
        # signal before they start raises (torchgpu.cli.signals), so the hand-off is
        # removed on every way out.
        with data_handoff(launched, example):
            del example
            code = _relaunch(launched, nproc, on_cuda)
            signals.settle()  # the run is over: a signal now changes nothing
        return code
    # SIGTERM/SIGINT from here on set the flag: one that lands in a collective or before
    # the first step is honoured at the first step boundary instead of killing the
    # process unsaved.
    with stop.installed():
        result = train(run=run, stop=stop)
        code = _finish(config, result.summary, result.out_dir is not None)
        signals.settle()
    return code


def _check_step_fits(run: Assembly) -> None:
    """Refuse (DataError, before any process starts or --out is made) an optimizer step
    that holds more samples than the train split: every data-parallel process's batch
    times --accumulate. One process with a batch larger than the split is refused where
    the data is loaded; this is the same rule for N processes (each would see a short
    share of one step, and the summary would claim a global batch the data does not
    have) and for accumulation."""
    from torchgpu.errors import DataError

    config = run.config
    try:
        samples = len(run.task.train)  # type: ignore[arg-type]
    except TypeError:  # not sized: the loader says what it can
        return
    batch = config.fixed_batch_size
    if batch is None:  # --batch-size auto: the search fits the step to the data later
        return
    ranks = run.choice.strategy.shard(0, run.nproc * config.nnodes).world_size
    step = ranks * batch * config.accumulate
    if step <= samples:
        return
    parts = " x ".join(p for p in (f"{ranks} processes" if ranks > 1 else "",
                                   f"--batch-size {batch}",
                                   f"--accumulate {config.accumulate}"
                                   if config.accumulate > 1 else "") if p)
    most = samples // (ranks * config.accumulate)
    fix = (f"use --batch-size {most} or less" if most >= 1 else
           "use fewer processes or a smaller --accumulate")
    raise DataError(
        f"the train split holds {samples} samples, fewer than one optimizer step of {step} "
        f"({parts}): {fix}"
        + (", fewer processes" if ranks > 1 and most >= 1 else "")
        + (" or a smaller --accumulate" if config.accumulate > 1 and most >= 1 else "")
        + ", or more data."
    )


def _stopped_before_start(stop: StopFlag) -> int:
    """A worker whose stop came while its process group was forming: nothing ran and
    nothing was written; rank 0 says so. A clean stop: exit code 0."""
    from torchgpu.distributed import DistEnv

    if DistEnv.from_env().is_main:
        print(f"torchgpu: stopped by {stop.signal_name or 'a stop signal'} before training "
              "started (the workers had not all joined yet): nothing was trained, and "
              "nothing in --out was written or changed.", file=sys.stderr)
    return 0


def _exit_worker(code: int) -> None:
    """End a worker of a torchgpu launcher now that everything is written: flush, then
    ``os._exit``, skipping the interpreter's teardown of torch (seconds under load, after
    a stop that must end within a bound). Not when the worker still has child processes
    (they are ended by the normal exit), nor under a launcher other than torchgpu's."""
    from torchgpu.launch.stop import child_pids
    from torchgpu.launch.stop_record import stop_file

    if stop_file() is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    if child_pids():
        return
    os._exit(code)


def _shown(gpus: str) -> str:
    """``--gpus``'s value for a message: as typed, quoted when empty or padded (visible)."""
    return gpus if gpus and gpus.strip() == gpus else repr(gpus)


def _set_gpus(config: TrainConfig) -> None:
    """``--gpus`` as CUDA_VISIBLE_DEVICES (before CUDA starts), then checked."""
    from torchgpu.devices import set_visible_devices
    from torchgpu.errors import VisibleDevicesError

    assert config.gpus is not None
    try:
        set_visible_devices(config.gpus)
    except VisibleDevicesError as error:  # name the flag the user typed
        raise VisibleDevicesError(
            f"--gpus {_shown(config.gpus)} (set as CUDA_VISIBLE_DEVICES): {error}"
        ) from None
    _check_gpus(config)


def _finish(config: TrainConfig, summary: dict[str, object], is_main: bool) -> int:
    if not is_main:  # not rank 0: rank 0 reports
        return 0
    if config.json:
        print(json.dumps(summary, indent=2))
    else:
        print(_report(summary))
    sys.stdout.flush()
    return 0
