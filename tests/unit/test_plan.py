"""Planner: device specs, per-strategy memory arithmetic and decisions on hypothetical devices."""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass

import pytest

from torchgpu.cli.train_flags import config_from_argv
from torchgpu.errors import PlanError, UsageError
from torchgpu.planning.candidates import all_candidates, halvings, partition_by_capacity
from torchgpu.planning.commands import run_device, train_command, train_settings
from torchgpu.planning.decide import SMALL_STEP_BYTES, bf16_would_fit
from torchgpu.planning.footprint import Footprint, LayerFootprint
from torchgpu.planning.planner import plan_from_footprint
from torchgpu.planning.targets import DeviceTarget, parse_devices
from torchgpu.planning.workload import Workload
from torchgpu.train.config import TrainConfig
from torchgpu.train.config_checks import validate
from torchgpu.train.strategies.split import device_list, parse_balance

GiB = 1024**3
MiB = 1024**2


def footprint(
    param_gib: float,
    act_gib_per_sample: float,
    ckpt_gib_per_sample: float | None = None,
    batch: int = 1,
    layers: int = 0,
    adam: bool = True,
) -> Footprint:
    """Fabricated numbers: fp32 params, equal grads, Adam's 2x state; ``layers`` equal layers."""
    p = int(param_gib * GiB)
    o = 2 * p if adam else 0
    act = int(act_gib_per_sample * GiB) * batch
    ckpt = (
        int(
            (ckpt_gib_per_sample if ckpt_gib_per_sample is not None else act_gib_per_sample / 4)
            * GiB
        )
        * batch
    )
    per = [
        LayerFootprint(f"l{i}", p // layers, p // layers, o // layers, act // layers, MiB * batch)
        for i in range(layers)
    ]
    return Footprint(batch, p, p, o, act, ckpt, 0, tuple(per))


def hypothetical(spec: str) -> list[DeviceTarget]:
    return parse_devices(
        spec, inventory=lambda: pytest.fail("hypothetical specs must not read the machine")
    )


def plan(fp: Footprint, spec: str, batch: int, example: str = "resnet50"):  # type: ignore[no-untyped-def]
    return plan_from_footprint(fp, hypothetical(spec), Workload(batch_size=batch, example=example))


# ------------------------------------------------------------------------ device specs
def test_parse_hypothetical_devices() -> None:
    four = hypothetical("4x80GiB")
    assert [t.name for t in four] == ["gpu0", "gpu1", "gpu2", "gpu3"]
    assert all(t.memory_bytes == 80 * GiB and t.usable_bytes == int(72 * GiB) for t in four)
    assert all(not t.real and t.kind == "cuda" for t in four)
    mixed = hypothetical("2x24GiB, 1x16GiB")
    assert [t.memory_bytes for t in mixed] == [24 * GiB, 24 * GiB, 16 * GiB]
    assert [t.memory_bytes for t in hypothetical("80GB")] == [80 * 10**9]
    assert [t.memory_bytes for t in hypothetical("2*40G")] == [40 * GiB] * 2


@pytest.mark.parametrize(
    "spec", ["", "4x", "x80GiB", "4x80", "0x80GiB", "4x80GiB,,1x8GiB", "four", "cuda:x", "4x80XB"]
)
def test_bad_device_specs_name_value_and_forms(spec: str) -> None:
    with pytest.raises(UsageError) as info:
        hypothetical(spec)
    message = str(info.value)
    assert repr(spec) in message
    assert "4x80GiB" in message and "cuda:0,cuda:1" in message


@dataclass(frozen=True)
class FakeInfo:
    kind: str
    index: int | None
    total_bytes: int | None
    free_bytes: int | None
    error: str | None = None


def test_real_devices_use_free_memory_and_missing_ones_are_named() -> None:
    infos = [
        FakeInfo("cuda", 0, 24 * GiB, 20 * GiB),
        FakeInfo("cuda", 1, 24 * GiB, 10 * GiB),
        FakeInfo("cpu", None, 64 * GiB, 50 * GiB),
    ]
    targets = parse_devices("cuda:0,cuda:1", inventory=lambda: infos)
    assert [(t.name, t.memory_bytes, t.real) for t in targets] == [
        ("cuda:0", 20 * GiB, True),
        ("cuda:1", 10 * GiB, True),
    ]
    with pytest.raises(
        UsageError, match=r"cuda:5 is not on this machine \(devices here: cuda:0, cuda:1, cpu\)"
    ):
        parse_devices("cuda:0,cuda:5", inventory=lambda: infos)
    with pytest.raises(UsageError, match="same device twice"):
        parse_devices("cuda:0,cuda:0", inventory=lambda: infos)


def test_auto_on_a_cpu_only_machine_is_the_cpu_with_its_ram() -> None:
    infos = [FakeInfo("cpu", None, 64 * GiB, 48 * GiB)]
    (cpu,) = parse_devices("auto", inventory=lambda: infos)
    assert (cpu.name, cpu.kind, cpu.memory_bytes, cpu.usable_bytes) == (
        "cpu",
        "cpu",
        48 * GiB,
        int(48 * GiB * 0.9),
    )


def test_auto_on_this_machine() -> None:
    targets = parse_devices("auto")
    assert targets and all(t.real and t.usable_bytes > 0 for t in targets)


# ---------------------------------------------------------------------- arithmetic
def test_halvings_keep_the_effective_batch() -> None:
    assert halvings(64, 64) == [(64, 1), (32, 2), (16, 4), (8, 8), (4, 16), (2, 32), (1, 64)]
    assert all(m * k == 48 for m, k in halvings(48, 48))


@pytest.mark.parametrize(
    ("costs", "caps", "expected"),
    [
        ([1, 1, 1, 1], [1, 1], [2, 2]),
        ([1, 1, 1, 1], [3, 1], [3, 1]),
        ([4, 1, 1, 1, 1], [1, 1], [1, 4]),
        ([1, 1, 1, 1, 1, 1, 1], [4, 2, 1], [4, 2, 1]),
        ([5, 5], [1, 1], [1, 1]),
    ],
)
def test_partition_by_capacity(costs: list[float], caps: list[float], expected: list[int]) -> None:
    assert partition_by_capacity(costs, caps) == expected


def test_memory_formulas_per_strategy() -> None:
    fp = footprint(1.0, 0.5, 0.125, batch=8, layers=4)  # S = 4 GiB, A(8) = 4 GiB
    rows = {c.label: c for c in all_candidates(fp, hypothetical("2x80GiB"), 8)}
    assert rows["single"].per_device_bytes == (8 * GiB,)
    assert rows["single + checkpointing"].per_device_bytes == (5 * GiB,)
    # ddp: states + a second copy of the gradients (buckets) + activations for 4 samples
    assert rows["ddp"].per_device_bytes == (4 * GiB + 1 * GiB + 2 * GiB,) * 2
    # fsdp: states / 2 + two gathered layers' params + one layer's grads + 4 samples
    assert rows["fsdp"].per_device_bytes == (2 * GiB + GiB // 2 + GiB // 4 + 2 * GiB,) * 2
    assert (
        rows["ddp + accumulation"].micro_batch == 2 and rows["ddp + accumulation"].accumulate == 2
    )
    assert rows["model (split)"].balance == (2, 2)
    assert rows["model (split)"].per_device_bytes == (4 * GiB,) * 2  # 2 GiB states + 2 GiB acts
    assert rows["pipeline"].chunks == 8
    for row in rows.values():
        assert row.effective_batch == 8
        assert row.fits


# ------------------------------------------------------------------------ decisions
def test_model_that_fits_on_one_device() -> None:
    result = plan(footprint(1.0, 0.25, batch=32), "1x80GiB", 32)  # 4 + 8 GiB
    assert (result.strategy, result.micro_batch, result.accumulate) == ("single", 32, 1)
    assert not result.activation_checkpointing
    assert result.command == "torchgpu train --example resnet50 --strategy single --batch-size 32"


def test_several_devices_give_ddp_with_the_batch_shared() -> None:
    result = plan(footprint(1.0, 0.25, batch=32), "4x80GiB", 32)
    assert (result.strategy, result.nproc, result.micro_batch, result.effective_batch) == (
        "ddp",
        4,
        8,
        32,
    )
    assert (
        result.command
        == "torchgpu train --example resnet50 --strategy ddp --nproc 4 --batch-size 8"
    )
    assert "least estimated slowdown" in result.reason


def test_small_model_stays_on_one_device() -> None:
    tiny = Footprint(16, 4096, 4096, 8192, 65536, 16384, 0, ())
    assert tiny.single_bytes(16) < SMALL_STEP_BYTES
    result = plan(tiny, "4x80GiB", 16, example="housing")
    assert result.strategy == "single"
    assert "start-up" in result.reason


def test_accumulation_is_preferred_to_checkpointing() -> None:
    # 64 samples x 0.5 GiB = 32 GiB of activations on a 24 GiB device: both rescue it
    result = plan(footprint(1.0, 0.5, batch=64), "1x24GiB", 64)
    assert (result.strategy, result.activation_checkpointing) == ("single", False)
    assert (result.micro_batch, result.accumulate) == (32, 2)
    assert result.effective_batch == 64
    assert "--accumulate 2" in (result.command or "")
    rows = {c.label: c for c in result.candidates}
    assert rows["single + checkpointing"].fits and not rows["single"].fits


def test_model_that_needs_checkpointing() -> None:
    # one sample's activations (20 GiB) do not fit a 16 GiB device; checkpointed (3 GiB) they do
    result = plan(footprint(0.5, 20.0, 3.0, batch=1), "1x16GiB", 1)
    assert result.strategy == "single"
    assert result.activation_checkpointing
    assert (result.micro_batch, result.accumulate) == (1, 1)
    assert result.command is not None and "--activation-checkpointing" in result.command
    rows = {c.label: c for c in result.candidates}
    assert not rows["single"].fits and not rows["single + accumulation"].fits


def test_model_that_needs_two_stages() -> None:
    # 32 GiB of states in two 16 GiB layers: no single/ddp/fsdp rank holds it, two stages do
    fp = footprint(8.0, 0.01, batch=16, layers=2)
    result = plan(fp, "2x24GiB", 16)
    assert result.strategy == "pipeline"
    assert result.balance == (1, 1)
    assert result.chunks == 8
    assert result.devices == ("gpu0", "gpu1")
    assert result.command == (
        "torchgpu train --example resnet50 --strategy pipeline --devices cuda:0,cuda:1 "
        "--balance 1,1 --chunks 8 --batch-size 16 --activation-checkpointing"
    )
    rows = {c.label: c for c in result.candidates}
    assert rows["model (split)"].fits  # fits too, but one device works at a time
    assert not any(
        rows[label].fits for label in rows if label.startswith(("single", "ddp", "fsdp"))
    )


def test_heterogeneous_devices_balance_by_capacity() -> None:
    fp = footprint(12.0, 0.01, batch=8, layers=6)  # 48 GiB of states, 8 GiB per layer
    result = plan(fp, "1x80GiB,1x24GiB", 8)
    assert result.strategy == "pipeline"
    # usable 72 and 21.6 GiB: 5 layers fill 40/72 = 56%, 1 layer 8/21.6 = 37%; an even
    # (3, 3) split would need 24 GiB on the small device
    assert result.balance == (5, 1)
    assert result.chosen.per_device_bytes[0] > result.chosen.per_device_bytes[1]
    # the command runs this cut, with the checkpointing the row was priced with
    assert result.command == (
        "torchgpu train --example resnet50 --strategy pipeline --devices cuda:0,cuda:1 "
        "--balance 5,1 --chunks 8 --batch-size 8 --activation-checkpointing"
    )


def test_model_that_fits_nowhere_names_the_numbers() -> None:
    with pytest.raises(PlanError) as info:
        plan(footprint(10.0, 0.1, batch=8, layers=4), "1x16GiB", 8)
    message = str(info.value)
    assert "40.0 GiB" in message  # model states
    assert "14.4 GiB usable" in message and "16.0 GiB less 10% headroom" in message
    assert "gpu0" in message
    # the states overflow: bf16 keeps them in fp32, so it is not suggested
    assert "--precision bf16" not in message and "would not help" in message


def test_bf16_is_suggested_only_when_the_activations_overflow() -> None:
    # states 2 GiB; one sample saves 2 GiB even checkpointed: 4 GiB > 3.6 GiB usable,
    # but with half the activation bytes (bf16) 3 GiB would fit
    acts = footprint(0.5, 8.0, 2.0, batch=1)
    assert (
        bf16_would_fit(
            all_candidates(acts, hypothetical("1x4GiB"), 1), acts, hypothetical("1x4GiB")
        )
        is not None
    )
    with pytest.raises(PlanError) as info:
        plan(acts, "1x4GiB", 1)
    assert "--precision bf16" in str(info.value)
    assert "single + checkpointing would fit" in str(info.value)
    # already bf16: nothing more to suggest
    with pytest.raises(PlanError) as info:
        plan_from_footprint(acts, hypothetical("1x4GiB"), Workload(1, precision="bf16"))
    assert "bf16" not in str(info.value)
    # states of 3.5 GiB with tiny activations on the same device: bf16 cannot help
    states = footprint(0.875, 0.001, batch=1)
    with pytest.raises(PlanError) as info:
        plan(states, "1x3GiB", 1)
    assert "--precision bf16" not in str(info.value) and "would not help" in str(info.value)


# ---------------------------------------------------- the command runs exactly the plan
def _train_config(command: str) -> TrainConfig:
    """``command`` parsed by ``torchgpu train``'s own parser and validated."""
    argv = shlex.split(command)
    assert argv[:2] == ["torchgpu", "train"]
    config = config_from_argv(argv[2:])
    validate(config)
    return config


def _infos_0_2() -> list[FakeInfo]:
    return [FakeInfo("cuda", 0, 80 * GiB, 80 * GiB), FakeInfo("cuda", 2, 80 * GiB, 80 * GiB)]


@pytest.mark.parametrize(
    ("spec", "fp", "batch", "precision"),
    [
        ("1x80GiB,1x24GiB", footprint(12.0, 0.01, batch=8, layers=6), 8, "fp32"),
        ("4x80GiB", footprint(1.0, 0.25, batch=32, layers=4), 32, "bf16"),
        ("1x16GiB,1x80GiB", footprint(0.5, 20.0, 3.0, batch=1, layers=2), 4, "fp32"),
        ("cuda:0,cuda:2", footprint(1.0, 0.5, batch=64, layers=4), 64, "fp32"),
    ],
)
def test_every_rows_command_parses_to_that_row(
    spec: str, fp: Footprint, batch: int, precision: str
) -> None:
    targets = parse_devices(spec, inventory=_infos_0_2)
    workload = Workload(batch, example="resnet50", precision=precision)
    result = plan_from_footprint(fp, targets, workload)
    assert result.settings == train_settings(result.chosen, targets)
    assert result.command == train_command(result.chosen, workload, targets)
    names = {t.name: run_device(t) for t in targets}
    rows = [c for c in result.candidates if c.applicable]
    assert {c.strategy for c in rows} == {"single", "ddp", "fsdp", "model", "pipeline"}
    for row in rows:
        command = train_command(row, workload, targets)
        assert command is not None
        config = _train_config(command)
        settings = train_settings(row, targets)
        assert {k: getattr(config, k) for k in settings.config_changes()} == (
            settings.config_changes()
        ), command
        assert (config.example, config.precision) == ("resnet50", precision)
        assert (config.strategy, config.batch_size, config.accumulate) == (
            row.strategy,
            row.micro_batch,
            row.accumulate,
        ), command
        assert config.activation_checkpointing == row.checkpointing, command
        used = [names[n] for n in row.devices]
        if row.strategy in ("model", "pipeline"):
            assert config.devices is not None and config.balance is not None
            assert device_list(config.devices) == used
            assert parse_balance(config.balance) == list(row.balance or ())
            assert config.chunks == (row.chunks if row.strategy == "pipeline" else None)
            assert config.device == "auto" and config.nproc is None
        elif row.strategy in ("ddp", "fsdp"):
            assert config.nproc == len(used) and config.devices is None
            ids = [u.split(":")[1] for u in used]
            visible = config.gpus.split(",") if config.gpus else [str(i) for i in range(len(ids))]
            assert visible == ids, command  # rank k trains on visible GPU k
        else:
            assert config.device == used[0] or (config.device == "auto" and used[0] == "cuda:0")
            assert config.nproc is None and config.devices is None


def test_model_split_command_and_real_single_device() -> None:
    fp = footprint(1.0, 0.25, batch=8, layers=4)
    targets = parse_devices("cuda:0,cuda:2", inventory=_infos_0_2)
    rows = {c.label: c for c in all_candidates(fp, targets, 8)}
    workload = Workload(8, example="lenet")
    assert train_command(rows["model (split)"], workload, targets) == (
        "torchgpu train --example lenet --strategy model --devices cuda:0,cuda:2 "
        "--balance 2,2 --batch-size 8"
    )
    assert train_command(rows["single"], workload, targets) == (
        "torchgpu train --example lenet --strategy single --device cuda:0 --batch-size 8"
    )


def test_custom_model_gets_python_instead_of_a_command() -> None:
    fp = footprint(12.0, 0.01, batch=8, layers=6)
    result = plan_from_footprint(
        fp, hypothetical("1x80GiB,1x24GiB"), Workload(8, model="pkg.models:Net.build")
    )
    assert result.strategy == "pipeline" and result.command is None
    assert result.python is not None
    lines = result.python.splitlines()
    assert lines[:2] == ["from pkg.models import Net", "from torchgpu import Pipeline"]
    assert (
        "model = Pipeline(Net.build(), devices=['cuda:0', 'cuda:1'], balance=[5, 1], "
        "chunks=8, checkpoint='except_last')"
    ) in lines
    compile(result.python, "<plan>", "exec")  # valid Python
    accum = plan_from_footprint(
        footprint(1.0, 0.5, batch=64), hypothetical("1x24GiB"), Workload(64, model="m.py:f")
    )
    assert accum.python is not None and accum.accumulate == 2
    assert "f = runpy.run_path('m.py')['f']" in accum.python
    assert "GradAccumulator(model, optimizer, steps=2)" in accum.python
    compile(accum.python, "<plan>", "exec")


def test_real_device_commands() -> None:
    infos = [FakeInfo("cuda", 0, 80 * GiB, 80 * GiB), FakeInfo("cuda", 2, 80 * GiB, 80 * GiB)]
    targets = parse_devices("cuda:0,cuda:2", inventory=lambda: infos)
    result = plan_from_footprint(
        footprint(1.0, 0.25, batch=32), targets, Workload(32, example="lenet", precision="bf16")
    )
    assert result.command == (
        "torchgpu train --example lenet --strategy ddp --gpus 0,2 --nproc 2 --batch-size 16 "
        "--precision bf16"
    )
    custom = plan_from_footprint(
        footprint(1.0, 0.25, batch=32), targets, Workload(32, model="pkg.mod:build")
    )
    assert custom.command is None
    assert custom.python is not None
    assert "torchrun --nproc-per-node 2" in custom.python
    assert "CUDA_VISIBLE_DEVICES=0,2" in custom.python
    assert "wrap_data_parallel(model, 'ddp')" in custom.python
    assert "from pkg.mod import build" in custom.python


# ---------------------------------------------------------------- measured, end to end
def test_measured_footprint_matches_saved_tensor_bytes() -> None:
    import torch

    from torchgpu.memory.saved_tensors import saved_tensor_bytes
    from torchgpu.models import build_model
    from torchgpu.planning.measure import measure_footprint

    model = build_model("lenet")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sample = torch.randn(4, 1, 28, 28)
    fp = measure_footprint(model, sample)
    # the estimator rounds each storage up to CUDA's 512-byte blocks
    measured = saved_tensor_bytes(lambda: model(sample))
    assert measured <= fp.activation_bytes <= measured * 1.02
    assert sum(layer.activation_bytes for layer in fp.layers) == fp.activation_bytes
    params = sum(p.numel() for p in model.parameters())
    assert 4 * params <= fp.param_bytes <= 4 * params * 1.02
    assert fp.grad_bytes <= fp.param_bytes and fp.optimizer_bytes == 2 * fp.grad_bytes
    assert fp.step_workspace_bytes == fp.grad_bytes  # Adam's foreach temporary
    assert 0 < fp.checkpointed_activation_bytes < fp.activation_bytes
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    sgd = measure_footprint(model, sample, optimizer="sgd")
    assert sgd.optimizer_bytes == 0
    meta = measure_footprint(model, torch.empty(4, 1, 28, 28, device="meta"))
    assert meta.activation_bytes == fp.activation_bytes


def test_plan_for_training_end_to_end() -> None:
    import torch

    from torchgpu.models import build_model
    from torchgpu.planning.planner import plan_for_training

    def factory() -> torch.nn.Module:
        return build_model("resnet50", num_classes=10)

    sample = torch.randn(2, 3, 64, 64)
    roomy = plan_for_training(factory, sample, batch_size=64, devices="2x40GiB", example="resnet50")
    assert roomy.strategy == "ddp" and roomy.nproc == 2 and roomy.micro_batch == 32
    assert roomy.command is not None and "--nproc 2" in roomy.command
    # a device whose usable memory holds a step of 24 samples but not 32: 16 x 4
    mib = math.ceil(roomy.footprint.single_bytes(24) / 0.9 / MiB)
    tight = plan_for_training(
        factory, sample, batch_size=64, devices=f"1x{mib}MiB", example="resnet50"
    )
    assert (tight.strategy, tight.micro_batch, tight.accumulate) == ("single", 16, 4)
    assert not tight.activation_checkpointing
    assert (
        tight.command
        == "torchgpu train --example resnet50 --strategy single --batch-size 16 --accumulate 4"
    )


# ------------------------------------------------------------- what a model can take
def test_checkpointing_rows_need_a_checkpointable_model() -> None:
    import dataclasses

    # the same numbers as test_model_that_needs_checkpointing, for a model that has no
    # layers and no repeated block: checkpointing cannot rescue it, so nothing fits
    fp = dataclasses.replace(footprint(0.5, 20.0, 3.0, batch=1), checkpointable=False)
    with pytest.raises(PlanError):
        plan(fp, "1x16GiB", 1)
    rows = {c.label: c for c in all_candidates(fp, hypothetical("1x16GiB"), 1)}
    row = rows["single + checkpointing"]
    assert not row.applicable and not row.fits
    assert "no layers or repeated block to checkpoint" in row.note


def test_measured_footprints_say_what_the_model_can_take() -> None:
    import torch
    from torch import nn

    from tests.user_models import TinyCausalLM
    from torchgpu.planning.measure import measure_footprint

    ids = torch.zeros(4, 12, dtype=torch.long, device="meta")
    lm = measure_footprint(TinyCausalLM(), {"input_ids": ids, "labels": ids})
    assert lm.checkpointable and lm.layers == ()  # repeated blocks, no split
    assert lm.checkpointed_activation_bytes < lm.activation_bytes / 2
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(4))
    listed = measure_footprint(blocks, torch.empty(4, 8, device="meta"))
    assert listed.checkpointable and len(listed.layers) == 4  # a list of blocks splits
    flat = measure_footprint(nn.Linear(8, 8), torch.empty(4, 8, device="meta"))
    assert not flat.checkpointable and flat.layers == ()
    rows = {c.label: c for c in all_candidates(lm, hypothetical("2x1GiB"), 4)}
    assert not rows["model"].applicable and not rows["pipeline"].applicable
