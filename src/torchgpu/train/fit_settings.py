"""The settings ``torchgpu.fit`` takes, typed for editors and type checkers: :class:`FitSettings`.

Each setting is the ``torchgpu train`` flag of the same name (``--batch-size`` is
``batch_size``) and means what the flag means. Names, types and defaults live in
``TrainConfig`` (a setting left out takes its default); ``FitSettings`` repeats them in the
form a type checker reads, with the wider forms ``fit`` also takes (``batch_size="auto"``,
``resume=True``, a ``Path`` for ``out``, a list for ``devices``), and
``tests/unit/test_fit_settings.py`` fails when the two drift. A misspelt or mistyped
setting is a mypy error and, at run time, a UsageError naming the closest accepted one
(:func:`unknown_settings_error`).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Iterable
from typing import Literal, TypedDict

from torchgpu.errors import UsageError
from torchgpu.train.config import TrainConfig

# TrainConfig fields that are no setting of fit: the command line's data and model
# sources and its launcher (fit runs in the processes ``torchgpu launch`` starts), and
# the fields fit takes as objects through its own keyword arguments (``loss``,
# ``metrics``, ``collate_fn``; ``optimizer`` and ``scheduler`` also take a name/spec
# there, which becomes the setting).
NOT_SETTINGS = frozenset({
    "example", "data", "target", "data_size", "model", "loss", "nproc", "nnodes",
    "node_rank", "rdzv_endpoint", "rdzv_timeout", "max_restarts", "gpus", "json", "auto_batch_size",
    "collate_fn", "metrics",
})
#: What :func:`~torchgpu.train.fit.config_from_settings` accepts: TrainConfig's fields
#: less :data:`NOT_SETTINGS`, in the config's order.
SETTINGS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(TrainConfig) if f.name not in NOT_SETTINGS)
#: Settings fit takes as keyword arguments of their own (an object, or a name/spec).
OWN_ARGUMENTS = ("optimizer", "scheduler")
#: fit's keyword arguments that no ``torchgpu train`` flag has (the CLI's ``--data``
#: gives both splits at once).
FIT_ONLY = ("eval_data",)


class FitSettings(TypedDict, total=False):
    """``fit``'s settings: the ``torchgpu train`` flags by name (see the module docstring;
    each one's meaning: ``torchgpu train --help`` and the comments of TrainConfig)."""

    device: str
    strategy: str
    chunks: int | str | None
    devices: str | list[str] | tuple[str, ...] | None
    balance: str | None
    schedule: str | None
    effective_batch_size: int | None
    accumulate: int
    activation_checkpointing: bool | str
    compile: bool
    compile_mode: str | None
    precision: str
    epochs: int | None
    steps_per_epoch: int | None
    batch_size: int | Literal["auto"] | None
    lr: float | None
    clip_norm: float | None
    lr_schedule: str
    warmup_steps: int
    lr_step_size: int | None
    lr_gamma: float | None
    seed: int
    out: str | os.PathLike[str] | None
    num_workers: int | str
    save_every: int | None
    async_save: bool
    keep_last: int | None
    resume: bool | str | os.PathLike[str] | None
    trust_checkpoint: bool
    overwrite: bool
    force_resume: bool
    autoresume: bool
    log_every: int | None
    on_nonfinite: str
    collective_timeout: float
    startup_timeout: float
    stop_timeout: float
    progress: str | None
    profile: int | None
    log: str
    memory_snapshot: bool
    estimate_memory: bool


def unknown_settings_error(names: Iterable[str]) -> UsageError:
    """The one-paragraph error for settings ``fit`` does not take: each name with the
    closest accepted one, then every accepted name."""
    accepted = (*SETTINGS, *FIT_ONLY, "loss", "metrics", "collate_fn")
    described = []
    for name in sorted(names):
        close = difflib.get_close_matches(name, accepted, n=1, cutoff=0.6)
        described.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
    return UsageError(
        f"fit() got unknown setting(s) {', '.join(described)}: the settings are the "
        f"`torchgpu train` flags' names: {', '.join(SETTINGS)}. Processes are started by "
        "`torchgpu launch --nproc N script.py`, not by a setting."
    )
