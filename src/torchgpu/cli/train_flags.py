"""The flags of ``torchgpu train``: the parser (every setting of
:class:`~torchgpu.train.config.TrainConfig`, ``--config FILE.toml`` supplying defaults the
command line overrides, ``--no-NAME`` resetting one) and the ``N|auto`` value types."""

from __future__ import annotations

import argparse
import dataclasses

from torchgpu.cli.common import ArgumentParser
from torchgpu.train.config import (
    DEFAULT_PROFILE_STEPS,
    EXAMPLES,
    LOG_FORMATS,
    ON_NONFINITE,
    OPTIMIZER_NAMES,
    PRECISIONS,
    PROGRESS_MODES,
    TrainConfig,
)
from torchgpu.train.config_file import FileSettings
from torchgpu.train.recipe.compiling import COMPILE_MODES
from torchgpu.train.schedule import SCHEDULES
from torchgpu.train.strategies.registry import describe as strategy_help
from torchgpu.train.strategies.registry import names as strategy_names


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
    dev.add_argument("--rdzv-timeout", type=float, default=600.0, metavar="SECONDS",
                     help="how long a node waits for every node at the rendezvous before "
                     "naming those missing (several nodes; default 600)")
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
                     "default): one per CPU core of the process's share but one, at most 16, "
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
    out.add_argument("--async-save", action=argparse.BooleanOptionalAction, default=False,
                     help="--strategy fsdp: write each sharded checkpoint while training goes "
                     "on (one save in flight at a time)")
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
    return parse_train_flags(argv)[0]


_UNSET = object()


def parse_train_flags(argv: list[str]) -> tuple[TrainConfig, FileSettings | None]:
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


def _int_or_auto(text: str, flag: str) -> int | str:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(  # argparse prints it and exits 2
            f"{text!r} is not an integer or auto (e.g. {flag} 4 or {flag} auto)"
        ) from None


def parse_chunks(text: str) -> int | str:
    """``--chunks`` value: an integer or ``auto`` (argparse ``type=``)."""
    return _int_or_auto(text, "--chunks")


def parse_batch_size(text: str) -> int | str:
    """``--batch-size`` value: an integer or ``auto`` (argparse ``type=``)."""
    return _int_or_auto(text, "--batch-size")


def parse_num_workers(text: str) -> int | str:
    """``--num-workers`` value: an integer or ``auto`` (argparse ``type=``)."""
    return _int_or_auto(text, "--num-workers")
