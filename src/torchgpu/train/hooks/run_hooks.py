"""Hooks into a run: code from outside the engine that acts at fixed points of it.

A :class:`RunHook` may wrap the ``--batch-size auto`` search's probe (an OOM there means
"does not fit"), wrap the loss each step calls (before the step's first wait on the other
ranks), and act after every optimizer step, after its due checkpoint; setting the stop flag
there stops the run at that boundary as a signal does (set on every rank at the same step,
the ranks stop together). A run's hooks (:meth:`RunHooks.for_run`, taken once at assembly)
are those ``installed`` in the process and those of the environment-activated plug-ins
(``ENV_PLUGINS``), which reach launched workers where no caller's code runs. With none,
the loop gets its loss and ``on_step`` unchanged: no per-step work.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchgpu.launch.stop_record import StopFlag
    from torchgpu.train.state import TrainState

LossFn = Callable[[Any, Any], Any]
StepHook = Callable[["TrainState"], None]

#: Environment-activated plug-ins: a prefix of variable names -> ``module:function``
#: (``function(rank, environ)`` returns the hooks this process runs). The plug-in is
#: imported only when a variable with its prefix is set. Both are test-only:
#: ``TORCHGPU_FAULT_*``, the planted crash or hang of one worker
#: (:mod:`torchgpu.train.hooks.faults`) that the restart and hang tests and the GPU kit set for
#: processes a launcher starts; ``TORCHGPU_SIMULATE_MEMORY_*``, a device that holds N
#: samples, for the batch-size search without a GPU (:mod:`torchgpu.train.hooks.simulated_memory`).
ENV_PLUGINS: dict[str, str] = {
    "TORCHGPU_FAULT_": "torchgpu.train.hooks.faults:hooks_from_env",
    "TORCHGPU_SIMULATE_MEMORY_": "torchgpu.train.hooks.simulated_memory:hooks_from_env",
}


class RunHook:
    """One hook into a run; every method defaults to nothing."""

    def wrap_probe(self, try_step: Callable[[int], None]) -> Callable[[int], None]:
        """The batch-size search's probe to call instead of ``try_step``."""
        return try_step

    def wrap_loss(self, loss_fn: LossFn, steps_done: Callable[[], int],
                  before: str) -> LossFn:
        """The loss function the step calls instead of ``loss_fn``. ``steps_done()``: the
        optimizer steps finished so far; ``before``: what of the step waits on the other
        ranks after the loss (for messages)."""
        return loss_fn

    def after_step(self, state: TrainState, stop: StopFlag) -> None:
        """After optimizer step ``state.step`` (and its checkpoint, if due)."""


_installed: list[RunHook] = []


@contextmanager
def installed(*hooks: RunHook) -> Iterator[None]:
    """Add ``hooks`` to every run assembled in this process inside the ``with``."""
    _installed.extend(hooks)
    try:
        yield
    finally:
        for hook in hooks:
            _installed.remove(hook)


@dataclass(frozen=True)
class RunHooks:
    """The hooks of one run, applied at the engine's hook points."""

    hooks: tuple[RunHook, ...] = ()

    @classmethod
    def for_run(cls, rank: int, environ: Mapping[str, str] | None = None) -> RunHooks:
        """The hooks installed now, then those the environment's plug-ins give for
        ``rank``. A plug-in raises a torchgpu error (ConfigError) for a bad variable."""
        env = os.environ if environ is None else environ
        found = list(_installed)
        for prefix, target in ENV_PLUGINS.items():
            if any(name.startswith(prefix) for name in env):
                module, _, function = target.partition(":")
                plugin: Callable[[int, Mapping[str, str]], Iterable[RunHook]] = getattr(
                    importlib.import_module(module), function)
                found.extend(plugin(rank, env))
        return cls(tuple(found))

    def wrap_loss(self, loss_fn: LossFn, steps_done: Callable[[], int],
                  before: str = "gradient all-reduce") -> LossFn:
        """``loss_fn`` wrapped by every hook (unchanged without hooks)."""
        for hook in self.hooks:
            loss_fn = hook.wrap_loss(loss_fn, steps_done, before)
        return loss_fn

    def wrap_probe(self, try_step: Callable[[int], None]) -> Callable[[int], None]:
        """``try_step`` wrapped by every hook (unchanged without hooks)."""
        for hook in self.hooks:
            try_step = hook.wrap_probe(try_step)
        return try_step

    def after_step(self, inner: StepHook | None, stop: StopFlag,
                   sync: Callable[[], bool] | None) -> StepHook | None:
        """The loop's ``on_step``: ``inner`` (the checkpoints), then every hook; when a
        hook set ``stop``, ``sync`` (DDP: the ranks agree now, so they stop at this
        boundary). ``inner`` itself without hooks."""
        if not self.hooks:
            return inner
        hooks = self.hooks

        def on_step(state: TrainState) -> None:
            if inner is not None:
                inner(state)
            was_set = stop.is_set()
            for hook in hooks:
                hook.after_step(state, stop)
            if sync is not None and stop.is_set() and not was_set:
                sync()
        return on_step
