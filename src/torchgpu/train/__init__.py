"""The training engine. ``train(TrainConfig(...)) -> TrainResult`` runs one training job
(what ``torchgpu train`` does); ``torchgpu.fit`` runs it on the user's own model and data.
Submodules import lazily.

The sub-packages are layers: none imports another that imports it back
(``tests/unit/test_import_graph.py``); ``docs/architecture.md`` lists them, top to bottom.
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
