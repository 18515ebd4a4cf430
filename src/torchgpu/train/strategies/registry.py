"""The registry: every strategy ``torchgpu train --strategy`` knows, one line each.

A new strategy is one module defining a :class:`~.base.Strategy` subclass and its
instance, plus one line in :data:`REGISTRY`; validation, the CLI's help, the runner,
checkpoints and the planner's names all read it from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchgpu.errors import ConfigError
from torchgpu.train.strategies.base import Choice, Strategy
from torchgpu.train.strategies.data_parallel import DDP, DP, FSDP
from torchgpu.train.strategies.single import SINGLE
from torchgpu.train.strategies.split import MODEL, Pipeline
from torchgpu.train.strategies.stages.strategy import STAGES

if TYPE_CHECKING:
    import torch  # only here: the CLI's parser reads names() and describe() without torch

#: ``--strategy auto``: decided per run (ddp with several processes, else single, unless
#: the planner finds the model does not fit one device: torchgpu.train.auto_strategy).
AUTO = "auto"

#: ``pipeline``: one process, or one stage per process with several (its ``staged``).
PIPELINE = Pipeline(staged=STAGES)

REGISTRY: dict[str, Strategy] = {
    SINGLE.name: SINGLE,
    DP.name: DP,
    DDP.name: DDP,
    FSDP.name: FSDP,
    MODEL.name: MODEL,
    PIPELINE.name: PIPELINE,
}


def names() -> tuple[str, ...]:
    """Every ``--strategy`` value, ``auto`` first."""
    return (AUTO, *REGISTRY)


def describe() -> str:
    """One clause per strategy, for ``--strategy``'s help: each strategy's own ``help``."""
    return "; ".join(f"{name}: {strategy.help}" for name, strategy in REGISTRY.items())


def get(name: str) -> Strategy:
    """The strategy called ``name`` (ConfigError naming the allowed ones otherwise)."""
    found = REGISTRY.get(name)
    if found is None:
        raise ConfigError(
            f"unknown strategy {name!r}: allowed are {', '.join(names())}. "
            "Pass one of them with --strategy.")
    return found


def choose(name: str, world: int, device: torch.device) -> Choice:
    """What runs for ``--strategy name`` with ``world`` processes on ``device``:
    ``auto`` is ddp with several processes, else single (the planner, when it runs,
    has already replaced ``auto`` by a concrete name)."""
    if name == AUTO:
        return Choice(REGISTRY["ddp"] if world > 1 else REGISTRY["single"])
    return get(name).choose(world, device)
