"""--profile [N]: the window arithmetic, the phase shares, and a real run whose Chrome
trace holds forward and backward events; with the flag off the loop's hook is untouched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from torchgpu.cli.train_flags import config_from_argv
from torchgpu.train.config import DEFAULT_PROFILE_STEPS, TrainConfig
from torchgpu.train.observe.observers import Observers
from torchgpu.train.observe.profiler import (
    FORWARD_LABEL,
    TABLE_FILE,
    TRACE_FILE,
    ProfileWindow,
    profile_window,
    step_shares,
    union_us,
)
from torchgpu.train.runner import train
from torchgpu.train.state import TrainState


@pytest.mark.parametrize(("requested", "remaining", "window"), [
    (5, 100, ProfileWindow(3, 5, 5)),
    (5, 8, ProfileWindow(3, 5, 5)),
    (5, 7, ProfileWindow(2, 5, 5)),
    (5, 5, ProfileWindow(0, 5, 5)),
    (5, 3, ProfileWindow(0, 3, 5)),  # a short run: all of it
    (1, 0, ProfileWindow(0, 0, 1)),
])
def test_profile_window(requested: int, remaining: int, window: ProfileWindow) -> None:
    assert profile_window(requested, remaining) == window
    assert (window.note() is None) == (window.steps == requested)


def test_a_profile_longer_than_the_run_says_so(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    result = train(TrainConfig(example="housing", data_size=64, epochs=1, batch_size=16,
                               device="cpu", out=str(tmp_path), progress="off", profile=1000))
    profile = result.summary["profile"]
    assert profile["requested_steps"] == 1000 and profile["steps"] == result.summary["steps"]
    err = capsys.readouterr().err
    assert (f"note: --profile 1000 asks for more steps than the run has left "
            f"({profile['steps']}): profiling all {profile['steps']}, without warm-up") in err


def test_union_counts_overlaps_once() -> None:
    assert union_us([]) == 0
    assert union_us([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20


def test_step_shares_count_each_moment_once() -> None:
    """Main thread (1): data, forward, the loss (forward's), backward with a collective
    called inside it (communication), a wait for another thread's all-reduce (exposed
    communication) and the optimizer; the all-reduce's part that overlaps the optimizer
    is hidden, not counted twice."""
    events = [
        ("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 0, 10, 1),
        (FORWARD_LABEL, 10, 30, 1), ("aten::addmm", 12, 20, 1),  # nested op: not a phase
        ("aten::mse_loss", 32, 35, 1),  # the loss, between forward and backward
        ("autograd::engine::evaluate_function: AddmmBackward0", 40, 50, 1),
        ("autograd::engine::evaluate_function: TBackward0", 52, 55, 1),  # engine gap: back
        ("c10d::allreduce_", 53, 54, 1),  # inside backward: the main thread communicates
        ("gloo:all_reduce", 54, 70, 2),  # another thread; 55..65 the main thread waits
        ("Optimizer.step#Adam.step", 65, 80, 1), ("Optimizer.zero_grad#Adam.zero_grad", 80, 85, 1),
    ]
    shares = step_shares(events, 100.0)
    assert shares == pytest.approx({"data": 0.1, "forward": 0.3, "backward": 0.14,
                                    "optimizer": 0.2, "communication": 0.11, "other": 0.15})
    assert sum(shares.values()) == pytest.approx(1.0)
    # events without threads are one thread's
    assert step_shares([(FORWARD_LABEL, 0, 50)], 100.0)["forward"] == 0.5


def test_flag_parsing() -> None:
    assert config_from_argv([]).profile is None
    assert config_from_argv(["--profile"]).profile == DEFAULT_PROFILE_STEPS
    assert config_from_argv(["--profile", "2"]).profile == 2


def test_profile_zero_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from torchgpu.cli.main import main

    assert main(["train", "--profile", "0", "--out", str(tmp_path / "o")]) == 2
    assert "--profile 0" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_profiled_run_writes_a_trace_with_forward_and_backward(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = train(TrainConfig(example="housing", data_size=96, epochs=1, batch_size=16,
                               device="cpu", out=str(tmp_path), progress="off", profile=2))
    trace = json.loads((tmp_path / TRACE_FILE).read_text())
    names = {event.get("name", "") for event in trace["traceEvents"]}
    assert FORWARD_LABEL in names
    assert any(n.startswith("autograd::engine::evaluate_function") for n in names)
    assert any(n.startswith("Optimizer.step#") for n in names)
    profile = result.summary["profile"]
    assert profile["steps"] == 2 and profile["warmup_steps"] == 3
    assert profile["shares"]["forward"] > 0 and profile["shares"]["backward"] > 0
    assert profile["top_operators"] and profile["step_seconds"] > 0
    assert result.summary["files"]["profile"] == str(tmp_path / TRACE_FILE)
    err = capsys.readouterr().err
    assert "share of step time" in err and "top operators by self time" in err
    assert "share of step time" in (tmp_path / TABLE_FILE).read_text()
    assert not result.model._forward_hooks and not result.model._forward_pre_hooks


def test_hook_untouched_without_flags(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    watch = Observers.start(TrainConfig(out=str(tmp_path)), model, torch.device("cpu"), 0,
                            tmp_path, TrainState(), 10)
    assert watch.wrap(None) is None
    hook = print
    assert watch.wrap(hook) is hook
    assert (watch.profiler, watch.tensorboard, watch.memory) == (None, None, None)
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_a_trace_that_cannot_take_its_place_is_an_error_not_a_silent_loss(
        tmp_path: Path) -> None:
    """torch's exporter only logs a failed rename; torchgpu checks the trace arrived and
    names the file in one paragraph, with no temporary left behind."""
    from torchgpu.errors import CheckpointWriteError
    from torchgpu.train.observe.profiler import export_trace

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(4).sum()
    (tmp_path / "profile.trace.json" / "inside").mkdir(parents=True)
    with pytest.raises(CheckpointWriteError, match=r"profile\.trace\.json: it is a directory"):
        export_trace(prof, tmp_path / "profile.trace.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile.trace.json"]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(4).sum()
    export_trace(prof, tmp_path / "t.json")
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile.trace.json", "t.json"]
