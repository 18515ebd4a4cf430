"""What a run's checkpoints start from: the resume plan and the run's hooks
(:class:`RunStart`), this process's place in the world (:class:`Ranks`), and what a loader
whose position a checkpoint keeps provides (``DataPosition``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from torchgpu.train.checkpoints.resume_plan import ResumePlan
from torchgpu.train.hooks.run_hooks import RunHooks


@dataclass(frozen=True)
class RunStart:
    """How the runner starts: the resume plan and the run's hooks
    (:mod:`torchgpu.train.hooks.run_hooks`)."""

    plan: ResumePlan = field(default_factory=ResumePlan)
    hooks: RunHooks = field(default_factory=RunHooks)


@dataclass(frozen=True)
class Ranks:
    """This process's rank and the world size (what save_checkpoint's ``dist`` needs)."""

    rank: int
    world_size: int

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


class DataPosition(Protocol):
    """A loader whose position a checkpoint keeps (a stream's:
    :class:`torchgpu.data.stream_loader.StreamLoader`)."""

    def position_state(self, epoch: int, batch: int) -> object | None: ...

    def resume_from(self, saved: object) -> None: ...
