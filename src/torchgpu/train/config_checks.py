"""Checks of every value of a :class:`~torchgpu.train.config.TrainConfig`.

``validate`` raises :class:`~torchgpu.errors.ConfigError` / ``UsageError`` with
one paragraph that names the value, what is allowed and the fix. It is pure: it touches
no device and no file system, so it runs before anything is created. It asks the module
that owns each concept to check its part (the strategy registry, the LR schedule,
``--compile``, metrics, optimizers, the launcher's node flags); those modules read
``TrainConfig`` themselves, which is why these checks are not in
``torchgpu.train.config``.
"""

from __future__ import annotations

import math

from torchgpu.errors import ConfigError, UsageError
from torchgpu.train import strategies
from torchgpu.train.config import (
    EXAMPLES,
    LOG_FORMATS,
    MAX_COLLECTIVE_TIMEOUT_S,
    MAX_COUNT,
    MAX_SEED,
    ON_NONFINITE,
    PRECISIONS,
    PROGRESS_MODES,
    TrainConfig,
)


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(
            f"unknown {name} {value!r}: allowed are {', '.join(allowed)}. "
            f"Pass one of them with --{name.replace('_', '-')}."
        )


def _at_least(name: str, value: int | float | None, low: int, why: str = "") -> None:
    if value is not None and value < low:
        raise ConfigError(
            f"--{name.replace('_', '-')} {value} is out of range: it must be >= {low}{why}. "
            f"Pass a value of at least {low}."
        )


def _at_most(name: str, value: int | None, high: int, why: str) -> None:
    if value is not None and value > high:
        raise ConfigError(
            f"--{name.replace('_', '-')} {value} is out of range: it must be <= {high}{why}. "
            f"Pass a smaller value."
        )


#: Flags counted in samples, steps or items, with what they count (for the message).
_COUNTS: tuple[tuple[str, str], ...] = (
    ("batch_size", " (samples per process and micro-batch)"),
    ("effective_batch_size", " (samples per optimizer step)"),
    ("data_size", " (samples)"),
    ("epochs", ""),
    ("steps_per_epoch", " (optimizer steps)"),
    ("accumulate", " (micro-batches per optimizer step)"),
    ("save_every", " (optimizer steps)"),
    ("keep_last", " (checkpoints)"),
    ("profile", " (optimizer steps)"),
    ("log_every", " (optimizer steps between metrics.jsonl writes)"),
    ("warmup_steps", " (optimizer steps)"),
    ("lr_step_size", " (epochs)"),
    ("max_restarts", ""),
    ("nnodes", ""),
)


#: DataLoader worker processes per CPU core at most (each holds a copy of the dataset).
WORKERS_PER_CORE = 4


def _check_num_workers(num_workers: int | str) -> None:
    from torchgpu.data.workers import AUTO, available_cores

    if num_workers == AUTO:
        return
    if not isinstance(num_workers, int) or isinstance(num_workers, bool):
        raise ConfigError(
            f"--num-workers {num_workers!r} is not a number of DataLoader processes: "
            "pass an integer (0 loads in the training process) or auto (chosen from "
            "the device and this process's CPU cores).")
    _at_least("num_workers", num_workers, 0)
    cores = available_cores()
    limit = WORKERS_PER_CORE * cores
    if num_workers > limit:
        raise ConfigError(
            f"--num-workers {num_workers} would start {num_workers} DataLoader processes "
            f"per training process on {cores} CPU cores; at most {limit} "
            f"({WORKERS_PER_CORE} per core) are allowed: use --num-workers {min(cores, limit)} "
            "or fewer (0 loads in the training process)."
        )


def _check_seed(seed: int) -> None:
    if not 0 <= seed <= MAX_SEED:
        raise ConfigError(
            f"--seed {seed} is out of range: a seed must be between 0 and {MAX_SEED} "
            "(2**63-1), the range every random generator of a run accepts. Pass e.g. "
            "--seed 0 or --seed 1234."
        )


def _check_gpus(gpus: str) -> None:
    """``--gpus`` must be a list CUDA reads as written (it becomes CUDA_VISIBLE_DEVICES)."""
    from torchgpu.devices.visible import validate_visible_devices

    try:
        validate_visible_devices(gpus)
    except ValueError as error:
        raise UsageError(
            f"--gpus {gpus!r} is not a GPU list: {error}. Pass comma-separated GPU ids as "
            "`torchgpu devices` lists them, each once, e.g. --gpus 0,1 (or GPU-/MIG- UUIDs)."
        ) from None


def _check_model_flags(config: TrainConfig) -> None:
    """``--model SPEC`` needs ``--data SPEC`` (or a CSV with ``--target``) and excludes
    ``--example``; ``--loss`` applies to ``--model`` only."""
    if config.collate_fn is not None and (config.model is None or config.target is not None):
        raise UsageError(
            f"--collate-fn {config.collate_fn} applies to your own --model SPEC with --data "
            "SPEC (a Dataset whose items it batches); built-in examples and CSV tables batch "
            "their own rows: drop --collate-fn, or train your model on your dataset."
        )
    if config.model is None:
        if config.loss is not None:
            raise UsageError(
                f"--loss {config.loss} was given without --model: built-in examples and CSV "
                "tables know their loss; --loss goes with your own --model SPEC."
            )
        return
    if config.example is not None:
        raise UsageError(
            f"--example {config.example} and --model {config.model} were both given: train "
            "either a built-in example or your own model, not both."
        )
    if not config.data:
        raise UsageError(
            f"--model {config.model} needs --data SPEC naming your data (module.path:attr or "
            "file.py:attr returning a Dataset or a (train, eval) pair), or --data FILE.csv "
            "--target COLUMN."
        )
    specs = [("--model", config.model, "a model or a function building one")]
    if config.target is None:  # else --data is a CSV file
        specs.append(("--data", config.data, "a Dataset, a (train, eval) pair, or a "
                      "function returning one"))
    if config.collate_fn is not None:
        specs.append(("--collate-fn", config.collate_fn, "a collate function fn(items) -> "
                      "batch, or a zero-argument factory returning one"))
    for flag, spec, what in specs:
        if ":" not in spec.strip(":"):
            raise UsageError(
                f"{flag} {spec} is not a spec: write module.path:attr or path/to/file.py:attr "
                f"(the attribute is {what})."
            )


def _check_checkpointing(value: bool | str, strategy: str) -> None:
    if not isinstance(value, str):
        return
    if strategy in ("model", "pipeline"):
        raise UsageError(
            f"--activation-checkpointing {value} names a block class, but --strategy "
            f"{strategy} checkpoints each stage's layers in segments: give the bare "
            "--activation-checkpointing flag (or use --strategy single/ddp to recompute "
            f"every {value}).")
    if not value.replace(".", "_").isidentifier():
        raise ConfigError(
            f"--activation-checkpointing {value!r} is not a class name: give the block class "
            "to recompute by name, e.g. --activation-checkpointing T5Block (fit: "
            "activation_checkpointing=\"T5Block\"), or the bare flag to detect it.")


def validate(config: TrainConfig) -> None:
    """Raise ConfigError / UsageError for the first bad value in ``config``.

    Checks names (example, strategy, precision, on_nonfinite, progress, optimizer), numbers
    (nproc >= 1, epochs >= 1, ...), and combinations (``--data`` needs ``--target``;
    ``--example`` and ``--data`` exclude each other; ``--keep-last`` needs
    ``--save-every``). Device specs and data files are checked where they are used.
    """
    if config.example is not None:
        _choice("example", config.example, EXAMPLES)
    if config.example is not None and config.data is not None:
        raise UsageError(
            f"--example {config.example} and --data {config.data} were both given: "
            "train either a built-in example or your CSV file, not both."
        )
    _check_model_flags(config)
    if config.data is not None and not config.target and config.model is None:
        raise UsageError(
            f"--data {config.data} needs --target COLUMN naming the column to predict, "
            "e.g. --target price."
        )
    if config.target is not None and config.data is None:
        raise UsageError(
            f"--target {config.target} was given without --data FILE: --target names a "
            "column of your CSV file; built-in examples know their own target."
        )
    strategies.check_name(config.strategy)
    _choice("precision", config.precision, PRECISIONS)
    _choice("on_nonfinite", config.on_nonfinite, ON_NONFINITE)
    _choice("progress", config.progress, PROGRESS_MODES)
    _choice("log", config.log, LOG_FORMATS)
    if config.metrics is not None:
        from torchgpu.train.metrics import check_specs

        check_specs(config.metrics)
    if config.optimizer is not None:
        from torchgpu.train.recipe.optimizers import check_name

        check_name(config.optimizer)
    from torchgpu.train.schedule import validate as check_schedule

    check_schedule(config)
    _at_least("profile", config.profile, 1, " (optimizer steps to trace)")
    _at_least("nproc", config.nproc, 1, " (the number of processes on this node)")
    from torchgpu.launch.run import check_nodes

    check_nodes(config.nnodes, config.node_rank, config.rdzv_endpoint)  # as `launch` does
    _at_least("max_restarts", config.max_restarts, 0)
    if isinstance(config.chunks, int):
        _at_least("chunks", config.chunks, 1)
    _at_least("accumulate", config.accumulate, 1, " (micro-batches per optimizer step)")
    _at_least("epochs", config.epochs, 1)
    _at_least("steps_per_epoch", config.steps_per_epoch, 1)
    _at_least("batch_size", config.batch_size, 1)
    _at_least("data_size", config.data_size, 1)
    _check_num_workers(config.num_workers)  # before the counts: it may be "auto"
    _at_least("save_every", config.save_every, 1, " (optimizer steps between checkpoints)")
    _at_least("keep_last", config.keep_last, 1)
    _at_least("log_every", config.log_every, 1, " (optimizer steps between writes)")
    for name, what in _COUNTS:
        _at_most(name, getattr(config, name), MAX_COUNT, what)
    if isinstance(config.chunks, int):
        _at_most("chunks", config.chunks, MAX_COUNT, " (micro-batches per batch)")
    _check_seed(config.seed)
    if config.gpus is not None:
        _check_gpus(config.gpus)
    if config.lr is not None and not (math.isfinite(config.lr) and config.lr > 0):
        raise ConfigError(
            f"--lr {config.lr} must be a positive finite number, e.g. --lr 0.001."
        )
    if config.clip_norm is not None and not (
        math.isfinite(config.clip_norm) and config.clip_norm > 0
    ):
        raise ConfigError(
            f"--clip-norm {config.clip_norm} must be a positive finite number, e.g. "
            "--clip-norm 1.0."
        )
    if not 0 < config.collective_timeout <= MAX_COLLECTIVE_TIMEOUT_S:  # nan fails too
        raise ConfigError(
            f"--collective-timeout {config.collective_timeout:g} is out of range: it must be "
            f"a number of seconds more than 0 and at most {MAX_COLLECTIVE_TIMEOUT_S} (about "
            f"{MAX_COLLECTIVE_TIMEOUT_S / 86400:.1f} days: torch's store waits on its sockets "
            "with a 32-bit count of milliseconds), e.g. --collective-timeout 300 (the default)."
        )
    for name, value, default in (("startup_timeout", config.startup_timeout, 600),
                                 ("stop_timeout", config.stop_timeout, 30),
                                 ("rdzv_timeout", config.rdzv_timeout, 600)):
        if not 0 < value <= MAX_COLLECTIVE_TIMEOUT_S:  # nan fails too
            raise ConfigError(
                f"--{name.replace('_', '-')} {value:g} is out of range: it must be a number "
                f"of seconds more than 0 and at most {MAX_COLLECTIVE_TIMEOUT_S}, e.g. "
                f"--{name.replace('_', '-')} {default} (the default)."
            )
    if config.keep_last is not None and config.save_every is None:
        raise UsageError(
            f"--keep-last {config.keep_last} only applies with --save-every N: "
            "add --save-every to write checkpoints."
        )
    strategies.check_config(config)  # the strategy's flags and features
    if config.overwrite and config.resume is not None:
        raise UsageError(
            f"--overwrite and --resume{' ' + config.resume if config.resume else ''} were "
            "both given: --resume continues the run in --out, --overwrite removes it and "
            "starts over. Pass one of them."
        )
    _check_autoresume(config)
    from torchgpu.train.recipe.compiling import validate as check_compile

    check_compile(config)
    _check_checkpointing(config.activation_checkpointing, config.strategy)
    if config.resume == "" and config.out is None:
        raise UsageError(
            "--resume without DIR continues the run in --out, but no --out was given: pass "
            "--out RUN_DIR (the run to continue), or --resume RUN_DIR."
        )


def _check_autoresume(config: TrainConfig) -> None:
    """``--autoresume`` decides itself whether the run continues: it excludes
    ``--resume`` and ``--overwrite``, and needs the ``--out`` every run of the job shares."""
    if not config.autoresume:
        return
    for flag, given in (("--resume", config.resume is not None),
                        ("--overwrite", config.overwrite)):
        if given:
            raise UsageError(
                f"--autoresume and {flag} were both given: --autoresume continues the run in "
                "--out when it has a checkpoint and starts it otherwise, so it decides what "
                f"{flag} would. Pass one of them."
            )
    if config.out is None:
        raise UsageError(
            "--autoresume needs --out: it continues the run in that directory, and without "
            "it every run would get a new timestamped directory (runs/<name>-<time>) and "
            "never find the previous one. Pass the same --out DIR on every run, e.g. "
            "--autoresume --out runs/my-job."
        )
