"""The model/pipeline flags of ``torchgpu train``, parsed without any device.

``--devices``, ``--balance``, ``--schedule``, ``--chunks M|auto`` and ``--batch-size
auto`` are parsed here (pure: no torch, no device, no file); the strategies check them
(:mod:`torchgpu.train.strategies.checks`, from each strategy's declared flags and
features), so :func:`torchgpu.train.config_checks.validate` refuses a bad combination before
anything is created. Rules:

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

from typing import Any, Literal

from torchgpu.errors import UsageError

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


def parse_num_workers(text: str) -> int | str:
    """``--num-workers`` value: an integer or ``auto`` (argparse ``type=``)."""
    return _int_or_auto(text, "--num-workers")


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
    if text == "size":
        return "size"
    if text == "time":
        return "time"
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
