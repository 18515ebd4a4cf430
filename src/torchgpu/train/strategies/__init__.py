"""Training strategies as objects, in one registry.

- :mod:`.base`: the :class:`Strategy` shape and its :class:`Features`; :mod:`.shard`:
  a rank's slice of the training order; :mod:`.run_steps`: what a strategy hands the
  run driver (the default model steps);
- :mod:`.single`, :mod:`.data_parallel` (dp, ddp, fsdp), :mod:`.split` (model and the
  one-process pipeline, with their flags), :mod:`.stages` (the pipeline with one stage
  per process, a package);
- :mod:`.registry`: name -> strategy (``--strategy`` values), and :func:`choose`;
- :mod:`.checks`: the flag checks that follow from the strategies' features.
"""

from __future__ import annotations

from torchgpu.train.strategies.base import Choice, Features, Strategy
from torchgpu.train.strategies.checks import check_config, check_name
from torchgpu.train.strategies.registry import AUTO, REGISTRY, choose, get, names

__all__ = ["AUTO", "REGISTRY", "Choice", "Features", "Strategy", "check_config", "check_name",
           "choose",
           "get", "names"]
