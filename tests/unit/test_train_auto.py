"""`--strategy auto` (the planner's decision) and `--batch-size auto` (the search), in one
process: the cheap skip, keeping the old rule when one device fits, applying a plan when
it does not, and the batch-size search under a simulated memory limit."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from torchgpu.errors import UsageError
from torchgpu.planning.footprint import Footprint, LayerFootprint
from torchgpu.planning.planner import plan_from_footprint
from torchgpu.planning.targets import parse_devices
from torchgpu.planning.workload import Workload
from torchgpu.train.auto_strategy import decide_strategy, planner_devices, step_bound_bytes
from torchgpu.train.config import TrainConfig, resolve
from torchgpu.train.guards.auto_batch import apply_auto_batch, search_batch_size
from torchgpu.train.hooks.run_hooks import RunHooks
from torchgpu.train.hooks.simulated_memory import SIMULATE_ENV, SimulatedMemory, simulated_limit
from torchgpu.train.runner import train

MiB = 1024**2


@pytest.fixture(scope="module")
def housing() -> Any:
    """The housing plug-in's Task (120 rows), as a run of --example housing has it."""
    from torchgpu.examples import housing as plugin

    return plugin.task(resolve(TrainConfig(example="housing", data_size=120, out="unused")))


def _config(**kw: Any) -> TrainConfig:
    return resolve(TrainConfig(example="housing", out="unused", **kw))


def _fake_plan(footprint: Footprint, devices: str) -> Any:
    def plan_fn(model: nn.Module, sample: torch.Tensor, **kw: Any) -> Any:
        assert sample.device.type == "meta"  # the planner never sees real data
        workload = Workload(batch_size=kw["batch_size"], example=kw["example"])
        return plan_from_footprint(footprint, parse_devices(devices), workload)

    return plan_fn


def _states(act: int, ckpt: int, layers: tuple[LayerFootprint, ...] = (), scale: int = 1
            ) -> Footprint:
    return Footprint(batch_size=16, param_bytes=scale * MiB, grad_bytes=scale * MiB,
                     optimizer_bytes=2 * scale * MiB, activation_bytes=act,
                     checkpointed_activation_bytes=ckpt, layers=layers)


def test_small_model_skips_the_planner_and_keeps_the_rule(housing: Any) -> None:
    def never(*a: Any, **k: Any) -> Any:
        raise AssertionError("the planner must not run for the housing net")

    one = decide_strategy(_config(), 1, housing, plan_fn=never)
    assert one.config.strategy == "single" and one.plan is None
    assert "planner skipped" in one.note and one.note.startswith("--strategy auto: single")
    two = decide_strategy(_config(), 2, housing, plan_fn=never)
    assert two.config.strategy == "ddp"
    # the bound counts weights x4 and grows with the batch
    model = nn.Linear(13, 1)
    x = torch.zeros(4, 13)
    assert step_bound_bytes(model, x, 64) > step_bound_bytes(model, x, 1) >= 4 * 14 * 4


def test_real_planner_on_this_cpu_keeps_single(housing: Any) -> None:
    decision = decide_strategy(_config(device="cpu"), 1, housing, small_step_bytes=0)
    assert decision.plan is not None and decision.config.strategy == "single"
    assert "the planner: one device fits" in decision.note
    assert decision.plan.targets[0].kind == "cpu"


def test_plan_with_accumulation_is_applied(housing: Any) -> None:
    plan_fn = _fake_plan(_states(300 * MiB, 40 * MiB), "1x100MiB")
    decision = decide_strategy(_config(), 1, housing, plan_fn=plan_fn, small_step_bytes=0)
    c = decision.config
    assert (c.strategy, c.batch_size, c.accumulate) == ("single", 4, 4)
    assert "--strategy auto: single" in decision.note and "effective batch" not in decision.note


def test_plan_needing_processes(housing: Any) -> None:
    plan_fn = _fake_plan(_states(300 * MiB, 290 * MiB), "2x200MiB")
    with pytest.raises(UsageError, match="--nproc 2"):
        decide_strategy(_config(), 1, housing, plan_fn=plan_fn, small_step_bytes=0)
    launched = decide_strategy(_config(), 1, housing, plan_fn=plan_fn, small_step_bytes=0,
                               launching=True)
    assert (launched.config.strategy, launched.config.nproc) == ("ddp", 2)
    assert launched.config.batch_size == 8


def test_plan_with_a_pipeline_sets_devices_chunks_balance(housing: Any) -> None:
    layers = tuple(LayerFootprint(f"l{i}", 50 * MiB, 50 * MiB, 100 * MiB, 16 * MiB, 4 * MiB)
                   for i in range(4))
    plan_fn = _fake_plan(_states(64 * MiB, 60 * MiB, layers, scale=200), "2x600MiB")
    c = decide_strategy(_config(), 1, housing, plan_fn=plan_fn, small_step_bytes=0).config
    assert (c.strategy, c.devices, c.chunks, c.balance) == ("pipeline", "cuda:0,cuda:1", 8, "2,2")
    assert c.activation_checkpointing and c.device == "auto"


@pytest.mark.parametrize(
    ("footprint", "devices", "launching", "label"),
    [
        (_states(300 * MiB, 40 * MiB), "1x100MiB", False, "single + accumulation"),
        (_states(300 * MiB, 290 * MiB), "2x200MiB", True, "ddp"),
        (_states(300 * MiB, 40 * MiB), "1x2MiB,1x300MiB", False, "single + accumulation"),
        (  # a pipeline with an uneven cut
            _states(
                64 * MiB,
                60 * MiB,
                tuple(
                    LayerFootprint(f"l{i}", 50 * MiB, 50 * MiB, 100 * MiB, 16 * MiB, 4 * MiB)
                    for i in range(6)
                ),
                scale=300,
            ),
            "1x1200MiB,1x400MiB",
            False,
            "pipeline",
        ),
    ],
)
def test_auto_runs_what_the_printed_command_runs(
    housing: Any, footprint: Footprint, devices: str, launching: bool, label: str
) -> None:
    """`train --strategy auto` and `torchgpu plan`'s command share one translation."""
    import shlex

    from torchgpu.cli.train_flags import config_from_argv

    decision = decide_strategy(
        _config(), 1, housing, plan_fn=_fake_plan(footprint, devices), small_step_bytes=0,
        launching=launching,
    )
    plan = decision.plan
    assert plan is not None and plan.command is not None and plan.chosen.label == label
    argv = shlex.split(plan.command)[2:]
    printed = resolve(config_from_argv([*argv, "--out", "unused"]))
    fields = ("strategy", "batch_size", "accumulate", "activation_checkpointing", "device",
              "gpus", "nproc", "devices", "balance", "chunks", "precision", "example")
    # auto applies a plan only when one device does not fit (else it keeps its rule)
    assert not next(c for c in plan.candidates if c.label == "single").fits
    auto = decision.config
    assert {f: getattr(auto, f) for f in fields} == {f: getattr(printed, f) for f in fields}
    assert auto.strategy == plan.strategy and auto.batch_size == plan.micro_batch
    if plan.strategy == "pipeline":
        assert plan.balance == (5, 1) and auto.balance == "5,1"  # not train's even default
        assert auto.activation_checkpointing  # the row was priced with except_last
    if devices == "1x2MiB,1x300MiB":  # single on the larger, second device
        assert plan.devices == ("gpu1",) and auto.device == "cuda:1"


def test_the_printed_pipeline_command_builds_the_planned_pipeline(housing: Any) -> None:
    """The command's --balance/--chunks/--activation-checkpointing reach the Pipeline that
    `torchgpu train` builds (stage devices cpu,cpu stand in for cuda:0,cuda:1)."""
    import shlex

    from torchgpu.cli.train_flags import config_from_argv
    from torchgpu.parallel.pipeline import Pipeline
    from torchgpu.planning.candidates import all_candidates
    from torchgpu.planning.commands import train_command
    from torchgpu.planning.measure import measure_footprint
    from torchgpu.train.strategies.split import build_split_model

    model = housing.build_model()
    fp = measure_footprint(model, housing.train.tensors[0][:16])
    targets = parse_devices("1x1GiB,1x100MiB")
    row = next(c for c in all_candidates(fp, targets, 16) if c.strategy == "pipeline")
    assert row.balance is not None and len(set(row.balance)) > 1  # uneven: by capacity
    command = train_command(row, Workload(16, example="housing"), targets)
    assert command is not None
    argv = shlex.split(command)[2:]
    argv[argv.index("--devices") + 1] = "cpu,cpu"
    parsed = resolve(config_from_argv([*argv, "--out", "unused"]))
    pipe = build_split_model(housing.build_model(), housing, parsed, torch.device("cpu"))
    assert isinstance(pipe, Pipeline)
    assert tuple(pipe.balance) == row.balance
    assert (pipe.chunks, pipe.checkpoint) == (row.chunks, "except_last")


def test_planner_devices() -> None:
    assert [planner_devices(_config(device=d)) for d in ("auto", "cuda", "cpu", "cuda:1", "1")
            ] == ["auto", "auto", "cpu", "cuda:1", "cuda:1"]


# ----------------------------------------------------------------------- batch size


def _memory(limit: int) -> RunHooks:
    """The run's hooks of a device that holds ``limit`` samples."""
    return RunHooks((SimulatedMemory(limit),))


def test_simulated_limit_parsing() -> None:
    assert simulated_limit(0, {}) is None
    assert simulated_limit(1, {SIMULATE_ENV: "40"}) == 40
    assert [simulated_limit(r, {SIMULATE_ENV: "40,24"}) for r in (0, 1, 2)] == [40, 24, 24]
    for bad in ("x", "0", "4,-1"):
        with pytest.raises(UsageError, match=SIMULATE_ENV):
            simulated_limit(0, {SIMULATE_ENV: bad})


@pytest.mark.parametrize("limit", [5, 37])
def test_search_finds_exactly_the_simulated_limit(housing: Any, limit: int) -> None:
    model = nn.Sequential(nn.Linear(13, 8), nn.ReLU(), nn.Linear(8, 1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    found = search_batch_size(model, nn.MSELoss(), housing, torch.device("cpu"),
                              hooks=_memory(limit))
    assert found.micro_batch == limit and found.accumulate == 1
    assert not found.search.capped
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_search_is_capped_by_the_data_and_keeps_the_effective_batch(housing: Any) -> None:
    model = nn.Linear(13, 1)
    rows = len(housing.train)
    capped = search_batch_size(model, nn.MSELoss(), housing, torch.device("cpu"))
    assert capped.micro_batch == rows and capped.search.capped  # a CPU never OOMs here
    kept = search_batch_size(model, nn.MSELoss(), housing, torch.device("cpu"),
                             effective_batch=96, hooks=_memory(37))
    assert (kept.micro_batch, kept.accumulate) == (32, 3)
    two = search_batch_size(model, nn.MSELoss(), housing, torch.device("cpu"), world_size=2,
                            effective_batch=96, hooks=_memory(20))
    assert two.micro_batch * two.accumulate == 48 and two.micro_batch <= 20
    with pytest.raises(UsageError, match="multiple of 2"):
        search_batch_size(model, nn.MSELoss(), housing, torch.device("cpu"), world_size=2,
                          effective_batch=95)


def test_ranks_agree_on_the_smaller_limit(housing: Any) -> None:
    """The other rank fits 12: with agree = min over both ranks, this one (fits 30) gets 12.
    (Two real gloo ranks: tests/distributed/test_train_auto_batch_gloo.py.)"""
    from torchgpu.memory.batch_size_search import find_batch_size
    from torchgpu.train.guards.auto_batch import make_probe

    probe = SimulatedMemory(30).wrap_probe(make_probe(
        nn.Linear(13, 1), nn.MSELoss(), *housing.train.tensors, torch.device("cpu")))
    sizes: list[int] = []

    def try_step(n: int) -> None:
        sizes.append(n)
        probe(n)

    def agree(fits_here: int) -> int:  # the minimum over this rank and the other one
        return min(fits_here, 1 if sizes[-1] <= 12 else 0)

    assert find_batch_size(try_step, start=16, max_size=96, agree=agree).size == 12


def test_batchnorm_statistics_and_rng_are_restored(housing: Any) -> None:
    model = nn.Sequential(nn.Linear(13, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 1))
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    search_batch_size(model, nn.MSELoss(), housing, torch.device("cpu"), hooks=_memory(9))
    assert torch.equal(torch.rand(3), expected)
    assert all(torch.equal(buffers[k], v) for k, v in model.named_buffers())


def test_train_with_auto_batch_and_a_simulated_limit(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(SIMULATE_ENV, "21")
    config = TrainConfig(example="housing", data_size=120, epochs=1, auto_batch_size=True,
                         effective_batch_size=40, device="cpu", progress="off",
                         out=str(tmp_path / "run"))
    result = train(config)
    assert (result.config.batch_size, result.config.accumulate) == (20, 2)
    assert result.summary["batch_size"] == 20 and result.summary["global_batch"] == 40
    err = capsys.readouterr().err
    assert "--batch-size auto: largest micro-batch that fits: 21" in err
    # without the flag nothing changes
    same, note = apply_auto_batch(dataclasses.replace(config, auto_batch_size=False),
                                  nn.Linear(13, 1), None, torch.device("cpu"), 1)
    assert note == "" and same.batch_size is None
