"""The training engine: a small loop composed of torchgpu's pieces.

``train(TrainConfig(...)) -> TrainResult`` runs one training job (what ``torchgpu train``
does): :mod:`~torchgpu.train.assemble` assembles it once, the strategy objects of
:mod:`~torchgpu.train.strategies` (one registry) place and wrap the model, and
:mod:`torchgpu.train.loop` (``run_epoch``, ``start_epoch``) with
:mod:`torchgpu.train.evaluation` (``evaluate``) trains it -- also for your own
composition. Submodules import lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["TrainConfig", "TrainResult", "TrainState", "train"]

_NAMES = {
    "TrainConfig": "torchgpu.train.config",
    "TrainResult": "torchgpu.train.report",
    "train": "torchgpu.train.runner",
    "TrainState": "torchgpu.train.state",
}


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'torchgpu.train' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


if TYPE_CHECKING:  # pragma: no cover
    from torchgpu.train.config import TrainConfig
    from torchgpu.train.report import TrainResult
    from torchgpu.train.runner import train
    from torchgpu.train.state import TrainState
