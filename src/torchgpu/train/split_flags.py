"""The model/pipeline flags of ``torchgpu train``, parsed and checked without any device.

``--devices``, ``--balance``, ``--schedule``, ``--chunks M|auto``, ``--batch-size auto``
and ``--effective-batch-size`` are validated here (pure: no torch, no device, no file),
so :func:`torchgpu.train.config.validate` refuses a bad combination before anything is
created. Rules:

- ``--devices LIST`` (``cpu,cpu``, ``cuda:0,cuda:1``, ``cuda:0,cuda:0``) only with
  ``--strategy model|pipeline``: at least two entries in one process; with ``--nproc N``
  (pipeline only) exactly N entries, one per process.
- ``--balance 3,2|size|time`` and ``--chunks`` only with ``--strategy pipeline`` (balance
  also with ``model``); ``--schedule gpipe|1f1b|interleaved1f1b`` only with ``pipeline``,
  and ``1f1b``/``interleaved1f1b`` only across processes (``--nproc``): one process runs
  GPipe fill-drain.
- 1F1B needs at least as many micro-batches (``--chunks``) as stages; interleaved 1F1B
  runs two stages per process and needs ``--chunks`` to be a multiple of ``--nproc``.
- ``model``/``pipeline`` run on one node (no ``--nnodes``) and ``model`` in one process
  (no ``--nproc``). ``--gpus 0,1`` only limits the visible GPUs: without ``--devices``
  the stages go to every visible GPU.
- ``--effective-batch-size E`` needs ``--batch-size auto`` and excludes ``--accumulate``.
"""

from __future__ import annotations

from typing import Any, Literal, cast

from torchgpu.errors import ConfigError, UsageError

SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved1f1b")
BALANCE_MODES: tuple[str, ...] = ("size", "time")
#: Stages each process holds under ``--schedule interleaved1f1b``.
INTERLEAVED_STAGES_PER_RANK = 2


def _int_or_auto(text: str, flag: str) -> int | str:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        import argparse

        raise argparse.ArgumentTypeError(  # argparse prints it and exits 2
            f"{text!r} is not an integer or auto (e.g. {flag} 4 or {flag} auto)"
        ) from None


def parse_chunks(text: str) -> int | str:
    """``--chunks`` value: an integer or ``auto`` (argparse ``type=``)."""
    return _int_or_auto(text, "--chunks")


def parse_batch_size(text: str) -> int | str:
    """``--batch-size`` value: an integer or ``auto`` (argparse ``type=``)."""
    return _int_or_auto(text, "--batch-size")


def device_list(spec: str) -> list[str]:
    """``"cuda:0, cuda:1"`` -> ``["cuda:0", "cuda:1"]``; UsageError for an empty item."""
    items = [item.strip() for item in spec.split(",")]
    if not spec.strip() or any(not item for item in items):
        raise UsageError(
            f"--devices {spec!r} is not a device list: give comma-separated devices such as "
            "cuda:0,cuda:1, cuda:0,cuda:0 or cpu,cpu."
        )
    return items


def parse_balance(spec: str) -> list[int] | Literal["size", "time"]:
    """``--balance`` as a list of layer counts, or ``"size"``/``"time"``."""
    text = spec.strip().lower()
    if text in BALANCE_MODES:
        return cast(Literal["size", "time"], text)
    try:
        counts = [int(item) for item in text.split(",")]
    except ValueError:
        raise UsageError(
            f"--balance {spec!r} is not understood: give layer counts per stage such as "
            "3,2, or size (parameters + activations) or time (profiled)."
        ) from None
    if any(c < 1 for c in counts):
        raise UsageError(
            f"--balance {spec!r} has a stage with {min(counts)} layers: every stage needs at "
            "least one layer, e.g. --balance 3,2."
        )
    return counts


def stages_per_rank(schedule: str | None) -> int:
    """Stages each process holds for ``schedule`` (2 for interleaved 1F1B, else 1)."""
    return INTERLEAVED_STAGES_PER_RANK if schedule == "interleaved1f1b" else 1


def processes(config: Any) -> int:
    """Processes the run has: ``--nproc``, else torchrun's ``WORLD_SIZE`` (workers get no
    ``--nproc``), else 1."""
    if config.nproc is not None:
        return int(config.nproc) * int(config.nnodes)
    import os

    world = os.environ.get("WORLD_SIZE", "")
    return int(world) if world.isdigit() and int(world) > 0 else 1


def validate_split_flags(config: Any) -> None:
    """Raise UsageError / ConfigError for a bad model/pipeline/batch-size combination.

    ``config`` is a :class:`~torchgpu.train.config.TrainConfig` (typed loosely so this
    module stays free of imports). No device is looked at; the process count is
    ``--nproc`` or, in a torchrun worker, ``WORLD_SIZE``.
    """
    strategy = config.strategy
    split = strategy in ("model", "pipeline")
    nproc = processes(config)
    if config.chunks is not None and config.chunks != "auto" and (
        isinstance(config.chunks, bool) or not isinstance(config.chunks, int)
    ):
        raise ConfigError(
            f"--chunks {config.chunks!r} is not a micro-batch count: pass a positive "
            "integer or auto."
        )
    if config.chunks is not None and strategy != "pipeline":
        raise UsageError(
            f"--chunks {config.chunks} only applies to --strategy pipeline (got --strategy "
            f"{strategy}): it sets the micro-batches of a pipeline. Use --strategy pipeline "
            "(with --devices or --nproc) or drop --chunks."
        )
    if config.schedule is not None:
        if config.schedule not in SCHEDULES:
            raise ConfigError(
                f"unknown schedule {config.schedule!r}: allowed are {', '.join(SCHEDULES)}. "
                "Pass one of them with --schedule."
            )
        if strategy != "pipeline":
            raise UsageError(
                f"--schedule {config.schedule} only applies to --strategy pipeline (got "
                f"--strategy {strategy}): drop --schedule or use --strategy pipeline."
            )
        if config.schedule != "gpipe" and nproc == 1:
            raise UsageError(
                f"--schedule {config.schedule} needs several processes (--nproc N): one "
                "process pipelines with GPipe fill-drain. Add --nproc 2 or use --schedule gpipe."
            )
    if config.balance is not None:
        if not split:
            raise UsageError(
                f"--balance {config.balance} only applies to --strategy model or pipeline "
                f"(got --strategy {strategy})."
            )
        parse_balance(config.balance)
    if config.devices is not None:
        if not split:
            raise UsageError(
                f"--devices {config.devices} places the stages of --strategy model or pipeline "
                f"(got --strategy {strategy}): use --device for one device, --gpus with --nproc "
                "for data parallelism."
            )
        devices = device_list(config.devices)
        if nproc == 1 and len(devices) < 2:
            raise UsageError(
                f"--strategy {strategy} --devices {config.devices} names one device: a split "
                "needs at least two stages, e.g. --devices cuda:0,cuda:1, or cuda:0,cuda:0 / "
                "cpu,cpu on a machine with one GPU or none."
            )
        if nproc > 1 and len(devices) != nproc:
            raise UsageError(
                f"--devices {config.devices} names {len(devices)} devices for --nproc {nproc}: "
                f"give one device per process ({nproc}), or drop --devices (cuda:LOCAL_RANK "
                "on GPUs, else cpu)."
            )
        gpus = [d for d in devices if d.startswith("cuda")]
        if nproc > 1 and len(set(gpus)) != len(gpus):
            raise UsageError(
                f"--devices {config.devices} puts two of the --nproc {nproc} processes on one "
                "GPU, which NCCL does not allow: give each process its own GPU (cuda:0,cuda:1), "
                "or pipeline in one process (drop --nproc: --devices cuda:0,cuda:0 works there)."
            )
        if config.device != "auto":
            raise UsageError(
                f"--device {config.device} and --devices {config.devices} were both given: "
                "--devices places every stage; drop --device."
            )
    if split:
        if config.nnodes > 1:
            raise UsageError(
                f"--nnodes {config.nnodes} is a data-parallel flag and --strategy {strategy} "
                "runs on one node: drop --nnodes and name the devices with --devices "
                "cuda:0,cuda:1 (or --gpus 0,1 to use those GPUs)."
            )
        if strategy == "model" and nproc > 1:
            raise UsageError(
                f"--strategy model runs in one process over several devices, but --nproc "
                f"{nproc} was given: drop --nproc, or use --strategy pipeline --nproc {nproc} "
                "for one stage per process."
            )
    if strategy == "pipeline" and nproc > 1 and isinstance(config.chunks, int):
        schedule = config.schedule or "gpipe"
        stages = nproc * stages_per_rank(schedule)
        if schedule == "1f1b" and config.chunks < stages:
            raise UsageError(
                f"--schedule 1f1b with --chunks {config.chunks} on {stages} stages: 1F1B needs "
                f"at least as many micro-batches as stages; use --chunks {stages} or more, or "
                "--schedule gpipe."
            )
        if schedule == "interleaved1f1b" and config.chunks % nproc:
            raise UsageError(
                f"--schedule interleaved1f1b with --chunks {config.chunks}: the micro-batches "
                f"must be a multiple of --nproc {nproc}, e.g. --chunks "
                f"{max(nproc, config.chunks - config.chunks % nproc)}."
            )
    if config.effective_batch_size is not None:
        if not config.auto_batch_size:
            raise UsageError(
                f"--effective-batch-size {config.effective_batch_size} goes with --batch-size "
                "auto (the search picks the micro-batch, accumulation makes up the rest); "
                "with a fixed --batch-size B use --accumulate K instead."
            )
        if config.accumulate != 1:
            raise UsageError(
                f"--effective-batch-size {config.effective_batch_size} and --accumulate "
                f"{config.accumulate} were both given: the accumulation follows from the "
                "effective batch; drop --accumulate."
            )
        if config.effective_batch_size < 1:
            raise ConfigError(
                f"--effective-batch-size {config.effective_batch_size} is out of range: it "
                "must be >= 1 (samples per optimizer step over all processes)."
            )
    if config.auto_batch_size and strategy == "fsdp":
        raise UsageError(
            "--batch-size auto does not support --strategy fsdp: its probes would run the "
            "sharded collectives, which hang when one rank runs out of memory. Pass "
            "--batch-size B, or use --strategy ddp."
        )
    if strategy == "pipeline" and nproc > 1 and (
        config.save_every is not None or config.resume is not None
    ):
        raise UsageError(
            "--save-every/--resume are not supported by --strategy pipeline with several "
            "processes yet (each process holds only its stages): run without them, or "
            "pipeline in one process with --devices."
        )
    if config.auto_batch_size and strategy == "pipeline" and nproc > 1:
        raise UsageError(
            "--batch-size auto does not support --strategy pipeline with --nproc: a stage "
            "that runs out of memory would leave the others waiting mid-schedule. Pass "
            "--batch-size B."
        )
