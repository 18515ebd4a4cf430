"""Every error torchgpu raises on purpose.

Each class derives from :class:`TorchGpuError` *and* from the nearest builtin, so
``except ValueError`` in user code keeps working. Every message names the bad value,
what is allowed, and how to fix it (DESIGN.md, principle 5).

The CLI maps these to exit codes through :func:`exit_code_for`:
0 ok, 1 runtime failure, 2 usage or bad input, 3 no usable device.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_NO_DEVICE = 3


class TorchGpuError(Exception):
    """Base of every error torchgpu raises on purpose.

    ``exit_code`` is what the CLI exits with when this error reaches it.
    """

    exit_code: int = EXIT_FAILURE


class UsageError(TorchGpuError, ValueError):
    """A CLI flag or argument combination that cannot work."""

    exit_code = EXIT_USAGE


class DeviceSpecError(TorchGpuError, ValueError):
    """A device string that is not one of the accepted forms, or names a missing device."""

    exit_code = EXIT_USAGE


class NoDeviceError(TorchGpuError, RuntimeError):
    """A device kind was required (CUDA, MPS) and none is usable; the message says why."""

    exit_code = EXIT_NO_DEVICE


class VisibleDevicesError(TorchGpuError, ValueError):
    """A bad CUDA_VISIBLE_DEVICES value, or an attempt to set it after CUDA started."""

    exit_code = EXIT_USAGE


class DeviceMismatchError(TorchGpuError, RuntimeError):
    """Parameters, buffers or inputs are not on the device they must be on."""

    exit_code = EXIT_FAILURE


class DataError(TorchGpuError, ValueError):
    """Bad training data: missing file or column, non-numeric cell, NaN, too few rows."""

    exit_code = EXIT_USAGE


class ConfigError(TorchGpuError, ValueError):
    """A configuration value (precision, strategy, balance, chunks...) that cannot work."""

    exit_code = EXIT_USAGE


class MicroBatchTypeError(ConfigError, TypeError):
    """A batch or a pipeline output that cannot be split into micro-batches along
    dim 0, or joined back, without changing the result (also a ``TypeError``)."""


class PlacementError(ConfigError, TypeError):
    """A call that would move a split model's stages to one device (``.to(device)``,
    ``.cuda()``, ``.cpu()``); also a ``TypeError``, as for a method the object lacks."""


class BalanceError(ConfigError):
    """A pipeline/model-parallel balance that does not partition the layers."""


class CheckpointError(TorchGpuError, RuntimeError):
    """A checkpoint that cannot be loaded into the target (keys, shapes, mapping)."""

    exit_code = EXIT_USAGE


class CheckpointWriteError(CheckpointError):
    """A checkpoint the file system would not take (disk full, permissions, I/O error):
    a runtime failure, not bad input -- the CLI exits 1. Nothing was committed."""

    exit_code = EXIT_FAILURE


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file whose bytes do not match its manifest (truncated, altered)."""


class CheckpointFormatError(CheckpointError):
    """A file that is not a valid checkpoint of any supported format, or is unsafe."""


class ResumeError(TorchGpuError, RuntimeError):
    """``--resume`` asked for, and no usable checkpoint to resume from."""

    exit_code = EXIT_USAGE


class ResumeStepsError(ResumeError, UsageError):
    """A resume that asks for fewer optimizer steps than its checkpoint has done: a
    resume continues a run, it never shortens one (also a :class:`UsageError`)."""


class NonFiniteLossError(TorchGpuError, FloatingPointError):
    """The loss became NaN or infinite; raised before it reaches the weights."""

    exit_code = EXIT_FAILURE


class EvaluationError(TorchGpuError, RuntimeError):
    """The held-out evaluation after an epoch failed (a metric, the loss, the data); the
    epoch's training was saved first and the message says where and how to continue."""

    exit_code = EXIT_FAILURE


class OutOfMemoryBackoffError(TorchGpuError, MemoryError):
    """Out of memory even at micro-batch 1: the step cannot fit on this device."""

    exit_code = EXIT_FAILURE


class PlanError(TorchGpuError, ValueError):
    """No strategy fits the model on the given devices; the message carries the numbers."""

    exit_code = EXIT_FAILURE


class DistributedError(TorchGpuError, RuntimeError):
    """A process group that could not be formed or a peer that failed."""

    exit_code = EXIT_FAILURE


class CollectiveTimeoutError(DistributedError):
    """A collective this rank waited in did not complete within ``--collective-timeout``
    (another rank never reached it); the launcher names the rank(s) that did not arrive."""


class StartupTimeoutError(DistributedError):
    """This rank waited ``--startup-timeout`` for the others to form the process group
    (one still building its model or loading its data); a failure, restartable."""


def exit_code_for(error: BaseException) -> int:
    """The CLI exit code for ``error``: its ``exit_code`` if ours, else 1."""
    if isinstance(error, TorchGpuError):
        return error.exit_code
    return EXIT_FAILURE


def first_line(error: BaseException, *, typed: bool = True, limit: int = 300) -> str:
    """The first line of ``error``'s message, for quoting inside one of our messages.

    ``typed``: ``"ValueError: bad value"`` (trailing full stop dropped, so the quote can
    sit mid-sentence), else the line alone (the type's name when the message is empty).
    Longer than ``limit`` characters, it is cut with ``...``.
    """
    lines = str(error).strip().splitlines()
    line = lines[0] if lines else ""
    if typed:
        line = f"{type(error).__name__}: {line.rstrip('. ')}".rstrip(": ")
    elif not line:
        line = type(error).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."
