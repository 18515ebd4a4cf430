"""The training engine. ``train(TrainConfig(...)) -> TrainResult`` runs one training job
(what ``torchgpu train`` does); :func:`torchgpu.fit` runs it on the user's own model and
data. Submodules import lazily.

The layout is the architecture; the sub-packages are layers (none imports another that
imports it back, ``tests/unit/test_import_graph.py``), top to bottom:

- the run: :mod:`.fit`, :mod:`.runner` (the run driver), :mod:`.assemble` (every check
  and decision, once, before ``--out`` exists) and what it asks: :mod:`.config_checks`
  (each concept checks its settings), :mod:`.placing` (device, strategy, wrapper),
  :mod:`.auto_strategy`, :mod:`.out_dir`, :mod:`.probe`, :mod:`.plugin`;
- :mod:`.observe`: what watches a run (progress, profiler, TensorBoard, memory);
- :mod:`.strategies` (the strategy objects in one registry, each one's run steps) and
  :mod:`.checkpoints` (saving, resuming, where a run starts);
- :mod:`.loop`: the epoch loop, one path for every strategy;
- :mod:`.guards` (what every rank decides alike, the stop's bound, ``--batch-size
  auto``) and :mod:`.outputs` (the files a run writes and what goes in them);
- leaves the rest reads: :mod:`.config` (settings only), :mod:`.config_file`,
  :mod:`.task` (the plug-in shape), :mod:`.metrics`, :mod:`.optimizers`,
  :mod:`.schedule`, :mod:`.stream_run`, :mod:`.compiling`, :mod:`.fingerprints`,
  :mod:`.faults` (test-only) and :mod:`.state` (where a run stands).
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
