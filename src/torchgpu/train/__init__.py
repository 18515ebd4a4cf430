"""The training engine: a small loop composed of torchgpu's pieces.

``train(TrainConfig(...)) -> TrainResult`` runs one training job (what ``torchgpu train``
does): :mod:`~torchgpu.train.assemble` assembles it once, the strategy objects of
:mod:`~torchgpu.train.strategies` (one registry) place and wrap the model, and
:mod:`torchgpu.train.loop.epoch` (``run_epoch``, ``start_epoch``) with
:mod:`torchgpu.train.outputs.evaluation` (``evaluate``) trains it -- also for your own
composition. Submodules import lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchgpu._lazy import exports

if TYPE_CHECKING:  # the exports, one name per line (read by torchgpu._lazy)
    from torchgpu.train.config import TrainConfig as TrainConfig
    from torchgpu.train.outputs.report import TrainResult as TrainResult
    from torchgpu.train.runner import train as train
    from torchgpu.train.state import TrainState as TrainState
else:
    __getattr__, __dir__, __all__ = exports(__name__, __file__)
