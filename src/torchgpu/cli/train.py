"""``torchgpu train``: train a built-in example or a CSV table on whatever devices exist.

Validates everything first (flags, device, data, ``--out``), then either trains in
this process or, with ``--nproc N`` / ``--nnodes`` / ``--max-restarts``, relaunches
itself under torchrun (one process per GPU, or N gloo processes on CPU). Prints where
the plot, metrics and model are; ``--json`` prints the summary JSON instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import TYPE_CHECKING

from torchgpu.cli.common import ArgumentParser
from torchgpu.cli.train_flags import parse_batch_size, parse_chunks, parse_num_workers
from torchgpu.train.compiling import COMPILE_MODES
from torchgpu.train.config import (
    DEFAULT_PROFILE_STEPS,
    EXAMPLES,
    LOG_FORMATS,
    ON_NONFINITE,
    PRECISIONS,
    PROGRESS_MODES,
    TrainConfig,
)
from torchgpu.train.config_file import FileSettings
from torchgpu.train.optimizers import OPTIMIZER_NAMES
from torchgpu.train.schedule import SCHEDULES
from torchgpu.train.strategies.registry import describe as strategy_help
from torchgpu.train.strategies.registry import names as strategy_names

if TYPE_CHECKING:
    from torchgpu.launch.stop_record import StopFlag
    from torchgpu.train.assemble import Assembly


def _parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="torchgpu train",
        description="Train a built-in example, your CSV table or your own model on CPU, one "
        "GPU or many.",
    )
    data = p.add_argument_group("data")
    data.add_argument("--example", help=f"built-in example: {'|'.join(EXAMPLES)} "
                      "(default housing)")
    data.add_argument("--model", metavar="SPEC", help="your model: module.path:attr or "
                      "file.py:attr (an nn.Module or a function building one)")
    data.add_argument("--data", metavar="FILE|SPEC", help="a numeric CSV table (with --target), "
                      "or with --model a spec returning a Dataset or a (train, eval) pair")
    data.add_argument("--loss", metavar="NAME|SPEC", help="with --model: mse|cross_entropy|"
                      "module:function (default: the model's own output.loss, dict batches)")
    data.add_argument("--collate-fn", metavar="SPEC", help="with --model/--data: module:attr "
                      "or file.py:attr, the function making a batch of items (e.g. padding "
                      "token sequences), or a zero-argument factory returning it")
    data.add_argument("--metrics", metavar="NAME|SPEC[,...]", help="evaluation metrics "
                      "besides the task's, each written as test_<name>: r2|accuracy or "
                      "module:function / file.py:function (fn(output, target) -> float, or a "
                      "class with reset/update/compute)")
    data.add_argument("--target", metavar="COL", help="the CSV column to predict")
    data.add_argument("--data-size", type=int, metavar="N",
                      help="shrink a built-in example to N samples (quick runs)")
    dev = p.add_argument_group("devices and processes")
    dev.add_argument("--device", default="auto", help="auto|cpu|cuda|cuda:N|mps (default auto)")
    dev.add_argument("--gpus", metavar="IDS", help="GPUs to use, e.g. 0,1 "
                     "(sets CUDA_VISIBLE_DEVICES before CUDA starts)")
    dev.add_argument("--nproc", type=int, metavar="N",
                     help="processes on this node (relaunches under torchrun)")
    dev.add_argument("--nnodes", type=int, default=1, metavar="N", help="nodes (default 1)")
    dev.add_argument("--node-rank", type=int, default=0, metavar="R")
    dev.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                     help="where the node agents meet (several nodes)")
    dev.add_argument("--max-restarts", type=int, default=0, metavar="R",
                     help="torchrun restarts of failed workers (default 0)")
    run = p.add_argument_group("training")
    run.add_argument("--strategy", default="auto", help=f"{'|'.join(strategy_names())} "
                     "(auto: ddp with several processes, else single, unless the planner "
                     f"finds the model does not fit one device; {strategy_help()})")
    run.add_argument("--chunks", type=parse_chunks, metavar="M|auto",
                     help="micro-batches per batch (pipeline); auto measures the fastest")
    run.add_argument("--devices", metavar="LIST", help="stage devices for --strategy "
                     "model|pipeline, e.g. cuda:0,cuda:1, cuda:0,cuda:0 or cpu,cpu")
    run.add_argument("--balance", metavar="3,2|size|time",
                     help="layers per stage (model|pipeline; default even)")
    run.add_argument("--schedule", metavar="NAME", help="gpipe|1f1b|interleaved1f1b "
                     "(pipeline; 1f1b kinds need --nproc; default gpipe)")
    run.add_argument("--accumulate", type=int, default=1, metavar="K",
                     help="micro-batches per optimizer step (default 1)")
    run.add_argument("--activation-checkpointing", nargs="?", const=True, default=False,
                     metavar="CLASS", help="recompute activations in backward to save "
                     "memory: the model's repeated block, or the block class named (e.g. "
                     "T5Block, BasicBlock)")
    run.add_argument("--no-activation-checkpointing", dest="activation_checkpointing",
                     action="store_false", help=argparse.SUPPRESS)
    run.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                     help="torch.compile the model (compiled at the first step; where it "
                     "cannot compile, the run says why and continues eager)")
    run.add_argument("--compile-mode", metavar="MODE", help=f"{'|'.join(COMPILE_MODES)} "
                     "(torch.compile's mode=, with --compile; default default)")
    run.add_argument("--precision", default="fp32", help=f"{'|'.join(PRECISIONS)} "
                     "(default fp32)")
    run.add_argument("--epochs", type=int, metavar="E")
    run.add_argument("--steps-per-epoch", type=int, metavar="N",
                     help="optimizer steps per epoch of streamed data (an IterableDataset)")
    run.add_argument("--batch-size", type=parse_batch_size, metavar="B|auto",
                     help="per process, per micro-batch; auto = the largest that fits")
    run.add_argument("--effective-batch-size", type=int, metavar="E",
                     help="with --batch-size auto: samples per optimizer step over all "
                     "processes, kept with accumulation")
    run.add_argument("--auto-batch-size", action=argparse.BooleanOptionalAction, default=False,
                     help=argparse.SUPPRESS)
    run.add_argument("--lr", type=float)
    run.add_argument("--optimizer", metavar="NAME|SPEC", help=f"{'|'.join(OPTIMIZER_NAMES)} "
                     "(at --lr) or module:function taking the params and returning an "
                     "Optimizer (default: adam for built-in examples and CSV tables, adamw "
                     "for --model)")
    run.add_argument("--lr-schedule", default="constant", metavar="NAME",
                     help=f"{'|'.join(SCHEDULES)}: the LR per optimizer step; linear and "
                     "cosine decay to 0 at the run's end (default constant)")
    run.add_argument("--warmup-steps", type=int, default=0, metavar="N",
                     help="optimizer steps of linear warm-up from LR 0 (default 0)")
    run.add_argument("--lr-step-size", type=int, metavar="EPOCHS",
                     help="--lr-schedule step: epochs between decays (default 1)")
    run.add_argument("--lr-gamma", type=float, metavar="G",
                     help="--lr-schedule step: the decay factor (default 0.1)")
    run.add_argument("--scheduler", metavar="SPEC", help="module:function taking the "
                     "optimizer and returning a torch LR scheduler (instead of --lr-schedule)")
    run.add_argument("--clip-norm", type=float, metavar="X", help="max gradient norm")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--num-workers", type=parse_num_workers, default="auto", metavar="N|auto",
                     help="DataLoader worker processes per training process; auto (the "
                     "default): one per CPU core of the process's share but one, at most 8, "
                     "on CUDA; 0 on the CPU and for in-memory tensors")
    run.add_argument("--collective-timeout", type=float, default=300.0, metavar="SECONDS",
                     help="with several processes: a rank that waits this long in a "
                     "collective stops the run, and the launcher names the rank that did not "
                     "arrive, its step and the collective (default 300)")
    run.add_argument("--startup-timeout", type=float, default=600.0, metavar="SECONDS",
                     help="with several processes: how long a rank waits for the others to "
                     "form the process group (building their model, loading data) before the "
                     "start-up fails, a failure --max-restarts retries (default 600)")
    run.add_argument("--stop-timeout", type=float, default=30.0, metavar="SECONDS",
                     help="after SIGTERM/SIGINT, how long the run may take to reach a step "
                     "boundary (where it saves) before it is ended without one, exit 128+N; "
                     "a second signal shortens it to 5 s (default 30)")
    run.add_argument("--on-nonfinite", default="stop", help=f"{'|'.join(ON_NONFINITE)}: a NaN/inf "
                     "loss stops the run, or its step is dropped (default stop)")
    out = p.add_argument_group("output and checkpoints")
    out.add_argument("--out", metavar="DIR",
                     help="output directory (default runs/<example>-<time>)")
    out.add_argument("--save-every", type=int, metavar="N",
                     help="write a checkpoint every N optimizer steps")
    out.add_argument("--keep-last", type=int, metavar="K", help="keep the K newest checkpoints")
    out.add_argument("--resume", nargs="?", const="", metavar="DIR",
                     help="continue from a checkpoint (default: the run's latest)")
    out.add_argument("--overwrite", action=argparse.BooleanOptionalAction, default=False,
                     help="an --out that holds a run: remove that run's files (only those) "
                     "and start over, instead of refusing")
    out.add_argument("--autoresume", action=argparse.BooleanOptionalAction, default=False,
                     help="continue the run in --out from its newest good checkpoint, or "
                     "start it when there is none; a finished run there: nothing to do "
                     "(exit 0). The same command for every run of a requeued job; needs --out")
    out.add_argument("--log-every", type=int, metavar="N",
                     help="write step losses to metrics.jsonl every N optimizer steps "
                     "(default: every 10 s of training, and at each epoch's end)")
    out.add_argument("--trust-checkpoint", action=argparse.BooleanOptionalAction, default=False,
                     help="with --resume: unpickle state.pt fully even if it needs globals "
                     "outside the weights-only allowlist (this can run code from the file)")
    out.add_argument("--force-resume", action=argparse.BooleanOptionalAction, default=False,
                     help="with --resume: go on although a --model/--data/--loss/--optimizer "
                     "file or the CSV changed since the checkpoint was saved (refused "
                     "otherwise)")
    out.add_argument("--progress", default="auto", help=f"{'|'.join(PROGRESS_MODES)} "
                     "(default auto: a bar on a terminal, one line per epoch otherwise)")
    out.add_argument("--json", action=argparse.BooleanOptionalAction, default=False,
                     help="print the summary as JSON")
    out.add_argument("--config", metavar="FILE.toml", help="settings from a TOML file (keys "
                     "= these flags' names); flags given here override it (--no-NAME puts an "
                     "optional setting back to its default, e.g. --no-profile, --no-save-every, "
                     "--no-estimate-memory); every run writes its own as OUT/config.toml")
    see = p.add_argument_group("profiles, logs and memory")
    see.add_argument("--profile", nargs="?", const=DEFAULT_PROFILE_STEPS, type=int, metavar="N",
                     help=f"trace N optimizer steps (default {DEFAULT_PROFILE_STEPS}) after "
                     "warm-up with torch.profiler: OUT/profile.trace.json (Perfetto) and a "
                     "table of the top operators and the step's phases")
    see.add_argument("--log", default="jsonl", help=f"{'|'.join(LOG_FORMATS)}: tensorboard "
                     "also writes event files to OUT/tensorboard (default jsonl)")
    see.add_argument("--memory-snapshot", action=argparse.BooleanOptionalAction, default=False,
                     help="CUDA: record the allocator's history, written as "
                     "OUT/memory_snapshot.pickle and .html")
    see.add_argument("--estimate-memory", action=argparse.BooleanOptionalAction, default=False,
                     help="put the planner's memory estimate next to the measured peak in "
                     "summary.json on CPU too (CUDA runs always do; about a second)")
    _add_resets(p)
    return p


def _add_resets(parser: ArgumentParser) -> None:
    """``--no-NAME`` for every setting that is off by default (``None``): it puts the
    setting back to its default, so one that a --config file sets can be switched off
    on the command line (``--no-profile``, ``--no-save-every``). Switches get theirs
    from BooleanOptionalAction. Hidden from --help; the --config flag names the rule."""
    fields = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    for action in list(parser._actions):
        if action.dest in fields and fields[action.dest] is None and action.option_strings:
            flag = action.option_strings[-1]
            parser.add_argument(f"--no-{flag[2:]}", dest=action.dest, action="store_const",
                                const=None, help=argparse.SUPPRESS)


def config_from_argv(argv: list[str]) -> TrainConfig:
    """Parse ``argv`` into a TrainConfig (argparse exits 2 on malformed flags).

    ``--config FILE.toml`` supplies defaults for every flag; flags in ``argv`` win.
    """
    return _parse(argv)[0]


_UNSET = object()


def _parse(argv: list[str]) -> tuple[TrainConfig, FileSettings | None]:
    """The config, and what it took from ``--config`` (None without one)."""
    parser = _parser()
    ns = vars(parser.parse_args(argv))
    from_file = None
    file_batch: object = None
    if ns.get("config") is not None:
        from torchgpu.train.config_file import read_settings

        keys: dict[str, str] = {}
        recorded: dict[str, str] = {}
        settings = read_settings(ns["config"], keys, recorded)
        file_batch = settings.get("batch_size")
        probe = _parser()  # which settings the command line gives: they win
        probe.set_defaults(**{a.dest: _UNSET for a in probe._actions if a.dest != "help"})
        given = {k for k, v in vars(probe.parse_args(argv)).items() if v is not _UNSET}
        parser.set_defaults(**settings)
        ns = vars(parser.parse_args(argv))
        from_file = FileSettings(ns["config"], {name: (keys[name], value) for name, value
                                                in settings.items() if name not in given},
                                 recorded)
    if ns.get("batch_size") == "auto":  # --batch-size auto: searched once the model exists
        # --config's batch_size (a number) stays the effective batch the search keeps
        ns["batch_size"] = file_batch if isinstance(file_batch, int) else None
        ns["auto_batch_size"] = True
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in ns.items() if k in fields}), from_file


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
        flight_recorder=on_cuda, torchgpu_workers=True,
    )
    return run(spec, "torchgpu", ["train", *worker_argv(config)])


_LAUNCH_ONLY = frozenset({"nproc", "nnodes", "node_rank", "rdzv_endpoint", "max_restarts", "gpus"})


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
    config, from_file = _parse(argv)
    from torchgpu.cli import signals
    from torchgpu.launch.stop_record import StopFlag
    from torchgpu.train.runner import train

    stop = StopFlag()
    if _under_torchrun():  # a worker: the launcher checked everything; train() assembles
        from torchgpu.distributed import GroupStopped

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
