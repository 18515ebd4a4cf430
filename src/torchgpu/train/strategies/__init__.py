"""Training strategies as objects, in one registry (``registry``: the ``--strategy`` values
and :func:`choose`).

Each strategy (``single``; ``data_parallel``: dp, ddp, fsdp; ``split``: model and the
one-process pipeline; ``stages``: one stage per process) has the shape of
``base.Strategy`` and hands the run driver its ``run_steps``; ``checks`` makes the flag
checks that follow from the strategies' declared features; ``placing`` turns a config into
the device, the strategy and the wrapped model.
"""

from __future__ import annotations

from torchgpu.train.strategies.base import Choice, Features, Strategy
from torchgpu.train.strategies.checks import check_config, check_name
from torchgpu.train.strategies.registry import AUTO, REGISTRY, choose, get, names

__all__ = ["AUTO", "REGISTRY", "Choice", "Features", "Strategy", "check_config", "check_name",
           "choose",
           "get", "names"]
