"""The run's hooks (torchgpu.train.hooks.run_hooks): what tests plant in a run (a step limit,
a crash, a hang) comes through one generic hook point, installed by the test or by an
environment-activated plug-in, never through a parameter of the engine's functions."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SRC
from tests.step_limit import StopAt, train_until
from torchgpu.errors import ConfigError
from torchgpu.launch.stop_record import StopFlag
from torchgpu.train.config import TrainConfig
from torchgpu.train.hooks.run_hooks import LossFn, RunHook, RunHooks, installed
from torchgpu.train.state import TrainState

# 100 samples -> 80 train rows, batch 16 -> 5 steps per epoch.
BASE: dict[str, Any] = {"example": "housing", "data_size": 100, "epochs": 2,
                        "batch_size": 16, "progress": "off", "device": "cpu"}


class Recorder(RunHook):
    """Records the steps it sees and the losses its wrapped loss computes."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.losses = 0

    def wrap_loss(self, loss_fn: LossFn, steps_done: Any, before: str) -> LossFn:
        def loss(out: Any, target: Any) -> Any:
            self.losses += 1
            return loss_fn(out, target)
        return loss

    def after_step(self, state: TrainState, stop: StopFlag) -> None:
        self.steps.append(state.step)


def test_installed_hooks_see_every_step_and_one_stops_the_run(tmp_path: Path) -> None:
    recorder = Recorder()
    with installed(recorder):
        result = train_until(7, TrainConfig(out=str(tmp_path / "run"), **BASE))
    assert recorder.steps == list(range(1, 8)) and recorder.losses == 7
    assert result.state.step == 7 and result.summary["stopped_early"]
    assert result.summary["checkpoints"]["last"].endswith("step-00000007")
    # outside the ``with`` a run has no hooks
    assert RunHooks.for_run(0, {}).hooks == ()


def test_the_fault_plugin_is_activated_by_its_variables_only() -> None:
    from torchgpu.train.hooks.faults import FaultHook

    assert RunHooks.for_run(0, {"PATH": "/bin"}).hooks == ()
    env = {"TORCHGPU_FAULT_HANG_AT_STEP": "3", "TORCHGPU_FAULT_RANK": "1"}
    assert RunHooks.for_run(0, env).hooks == ()  # another rank's fault
    (hook,) = RunHooks.for_run(1, env).hooks
    assert isinstance(hook, FaultHook) and hook.hang is not None and hook.hang.step == 3
    with pytest.raises(ConfigError, match="TORCHGPU_FAULT_HANG_AT_STEP"):
        RunHooks.for_run(0, {"TORCHGPU_FAULT_HANG_AT_STEP": "soon"})
    with installed(StopAt(2)):  # the installed ones first, then the plug-ins'
        kinds = [type(h).__name__ for h in RunHooks.for_run(1, env).hooks]
    assert kinds == ["StopAt", "FaultHook"]


def test_no_engine_signature_carries_a_test_only_parameter() -> None:
    """The step limit, the planted faults and the simulated memory are hooks: no
    parameter or field of the engine exists for them, and only their plug-ins read the
    variables."""
    from torchgpu.train.assemble import Assembly, assemble
    from torchgpu.train.checkpoints.run_checkpoints import RunCheckpoints
    from torchgpu.train.checkpoints.run_start import RunStart
    from torchgpu.train.guards.auto_batch import apply_auto_batch, make_probe, search_batch_size
    from torchgpu.train.runner import train
    from torchgpu.train.strategies.run_steps import StepContext

    test_only = {"stop_at_step", "crash", "hang", "memory_limit", "limit_samples"}
    for function in (train, assemble, RunCheckpoints.__init__, apply_auto_batch,
                     search_batch_size, make_probe):
        assert not test_only & set(inspect.signature(function).parameters), function
    for kind in (RunStart, StepContext, Assembly):
        assert not test_only & {f.name for f in dataclasses.fields(kind)}, kind
    for words, plugin in ((("TORCHGPU_FAULT", "faults import"), "faults.py"),
                          (("TORCHGPU_SIMULATE", "simulated_memory import"),
                           "simulated_memory.py")):
        readers = sorted(path.name for path in SRC.rglob("*.py")
                         if any(w in path.read_text(encoding="utf-8") for w in words))
        assert readers == sorted([plugin, "run_hooks.py"]), readers


def test_a_hook_that_stops_makes_the_ranks_agree_at_that_step() -> None:
    """After the checkpoints' own ``on_step``, the hooks run; the ranks sync (DDP's
    agreement) at the step a hook set the stop flag, and only then."""
    calls: list[str] = []
    stop = StopFlag()
    on_step = RunHooks((StopAt(2),)).after_step(lambda state: calls.append(f"save {state.step}"),
                                                stop, lambda: calls.append("sync") is None)
    assert on_step is not None
    state = TrainState()
    for step in (1, 2, 3):
        state.step = step
        on_step(state)
    assert calls == ["save 1", "save 2", "sync", "save 3"] and stop.signal_name == "step limit"
    assert RunHooks().after_step(None, stop, None) is None  # no hooks: no per-step work
