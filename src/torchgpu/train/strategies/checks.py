"""The strategy flags of a config, checked from the strategies' declarations (pure).

``check_config`` runs inside :func:`torchgpu.train.config_checks.validate`: the strategy's
name, the strategy-only flags (``--chunks``, ``--schedule``, ``--balance``,
``--devices``: refused by a strategy whose ``Features.flags`` lacks them), the
process count (a one-process strategy with ``--nproc``), the features it lacks
(``--save-every``/``--resume``, ``--batch-size auto``, a ``--precision``), each with the
strategy's reason, then the strategy's own :meth:`~.base.Strategy.check`. The process
count is ``--nproc`` or, in a torchrun worker, ``WORLD_SIZE``; no device is looked at.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchgpu.errors import ConfigError, UsageError
from torchgpu.train.strategies.base import Strategy, processes
from torchgpu.train.strategies.registry import AUTO, REGISTRY, get
from torchgpu.train.strategies.split import SCHEDULES, device_list, parse_balance

if TYPE_CHECKING:
    from torchgpu.train.config import TrainConfig

#: What each strategy-only flag does, for the message refusing it elsewhere.
_FLAG_HELP = {
    "chunks": "it sets the micro-batches of a pipeline. Use --strategy pipeline (with "
              "--devices or --nproc) or drop --chunks",
    "schedule": "drop --schedule or use --strategy pipeline",
    "balance": "it sets the layers per stage; drop --balance",
    "devices": "it places the stages; use --device for one device, --gpus with --nproc "
               "for data parallelism",
}


def _accepting(flag: str) -> str:
    return " or ".join(name for name, s in REGISTRY.items() if flag in s.features.flags)


def _check_values(config: TrainConfig) -> None:
    """The strategy flags' own values, whatever the strategy."""
    if config.chunks is not None and config.chunks != "auto" and (
        isinstance(config.chunks, bool) or not isinstance(config.chunks, int)
    ):
        raise ConfigError(
            f"--chunks {config.chunks!r} is not a micro-batch count: pass a positive "
            "integer or auto.")
    if config.schedule is not None and config.schedule not in SCHEDULES:
        raise ConfigError(
            f"unknown schedule {config.schedule!r}: allowed are {', '.join(SCHEDULES)}. "
            "Pass one of them with --schedule.")


def _check_flags(config: TrainConfig, strategy: Strategy | None) -> None:
    """A strategy-only flag given to a strategy that does not take it."""
    taken = strategy.features.flags if strategy is not None else frozenset()
    for flag in ("chunks", "schedule", "balance", "devices"):
        value = getattr(config, flag)
        if value is not None and flag not in taken:
            raise UsageError(
                f"--{flag} {value} only applies to --strategy {_accepting(flag)} (got "
                f"--strategy {config.strategy}): {_FLAG_HELP[flag]}.")
    if config.balance is not None:
        parse_balance(config.balance)
    if config.devices is not None:
        device_list(config.devices)


def _check_features(config: TrainConfig, strategy: Strategy) -> None:
    """What ``strategy`` declares it cannot do, asked for anyway."""
    features = strategy.features
    if features.resume is not None and (config.save_every is not None
                                        or config.resume is not None):
        raise UsageError(
            f"--save-every/--resume are not supported by {strategy.described}: "
            f"{features.resume}.")
    if features.auto_batch is not None and config.auto_batch_size:
        raise UsageError(
            f"--batch-size auto does not support {strategy.described}: {features.auto_batch}.")
    if features.compile is not None and config.compile:
        raise UsageError(
            f"--compile is not supported by {strategy.described}: {features.compile}; drop "
            "--compile, or use --strategy single/ddp.")
    if config.precision not in features.precisions:
        raise UsageError(
            f"--precision {config.precision} is not supported by {strategy.described} (it "
            f"takes {', '.join(features.precisions)}): {features.precision_why}.")


def _check_batch_flags(config: TrainConfig) -> None:
    if config.effective_batch_size is None:
        return
    if config.accumulate != 1:
        raise UsageError(
            f"--effective-batch-size {config.effective_batch_size} and --accumulate "
            f"{config.accumulate} were both given: the accumulation follows from the "
            "effective batch; drop --accumulate.")
    if config.effective_batch_size < 1:
        raise ConfigError(
            f"--effective-batch-size {config.effective_batch_size} is out of range: it "
            "must be >= 1 (samples per optimizer step over all processes).")


def check_name(name: str) -> None:
    """ConfigError for a ``--strategy`` value that is not ``auto`` or registered."""
    if name != AUTO:
        get(name)


def check_config(config: TrainConfig) -> None:
    """Raise UsageError / ConfigError for a bad strategy/flag combination (see the
    module docstring)."""
    check_name(config.strategy)
    nproc = processes(config)
    requested = None if config.strategy == AUTO else get(config.strategy)
    _check_values(config)
    _check_flags(config, requested)
    if requested is not None:
        if requested.processes == "one" and nproc > 1:
            raise UsageError(requested.one_process_message(nproc))
        runs = requested.for_processes(nproc)
        runs.check(config, nproc)
        _check_features(config, runs)
    _check_batch_flags(config)
