"""The memory estimate a run records beside its measured peak (train/observe/memory_report.py):
made on a meta twin of the trained model (the factory runs once per run), labelled with
the devices that ran, and honest about what a CPU peak is."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.user_models import BNConvNet, ImageDataset, TinyCausalLM, TokenDataset
from torchgpu import estimate_memory, fit
from torchgpu.distributed import free_port
from torchgpu.memory.activation_checkpointing import apply_activation_checkpointing
from torchgpu.train.config import TrainConfig
from torchgpu.train.observe.memory_report import memory_estimate, meta_twin
from torchgpu.train.task import user_task


def _lm() -> TinyCausalLM:
    torch.manual_seed(0)
    return TinyCausalLM()


def _sample(rows: int) -> dict[str, torch.Tensor]:
    ids = TokenDataset(rows).ids
    return {"input_ids": ids, "labels": ids}


def test_the_model_factory_runs_once_with_estimate_memory(tmp_path: Path) -> None:
    built: list[int] = []

    def factory() -> TinyCausalLM:
        built.append(1)
        return TinyCausalLM()

    result = fit(factory, TokenDataset(16), epochs=1, batch_size=8, out=tmp_path / "run",
                 progress="off", estimate_memory=True, strategy="single")
    assert len(built) == 1  # the estimate did not build a second model
    entry = result.summary["memory_estimate"]
    assert entry["source"] == "estimate_memory" and entry["devices"] == ["cpu"]
    expected = estimate_memory(_lm(), _sample(8), optimizer="adam", devices=["cpu"])
    assert entry["per_device_bytes"] == [expected.devices[0].peak_bytes]
    # a CPU peak is the process's resident memory: the record says it is no check
    assert entry["comparable"] is False and "resident memory" in entry["measured"]
    assert result.summary["devices"][0]["estimated_peak_bytes"] == expected.devices[0].peak_bytes


def test_meta_twin_is_the_plain_structure_on_meta() -> None:
    model = _lm()
    apply_activation_checkpointing(model)
    calls: list[int] = []
    model.head.register_forward_pre_hook(lambda *_: calls.append(1))
    twin = meta_twin(model)
    assert twin is not model and type(twin) is TinyCausalLM
    assert all(p.is_meta for p in twin.parameters()) and all(b.is_meta for b in twin.buffers())
    assert twin.head.weight is twin.embed.weight  # tied stays tied
    assert not twin.head._forward_pre_hooks  # hooks stay with the trained model
    assert [type(b) for b in twin.blocks] == [type(b) for b in _lm().blocks]  # no checkpoint
    assert list(twin.state_dict()) == list(_lm().state_dict())
    # the trained model is untouched: real weights, its hook and checkpointing kept
    assert not any(p.is_meta for p in model.parameters()) and model.head._forward_pre_hooks
    model(**_sample(2))
    assert calls == [1]
    plain = estimate_memory(_lm(), _sample(4), activation_checkpointing=True)
    assert estimate_memory(twin, _sample(4), activation_checkpointing=True) == plain


@pytest.fixture
def gloo_world_of_one(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_meta_twin_of_an_fsdp_model_has_the_full_shapes(gloo_world_of_one: None) -> None:
    from torchgpu.parallel.data import wrap_data_parallel

    sharded = wrap_data_parallel(_lm(), "fsdp")
    sharded(**_sample(2)).loss.backward()  # trained: parameters resharded DTensors
    twin = meta_twin(sharded)
    assert type(twin) is TinyCausalLM and type(twin.head) is nn.Linear  # no FSDP classes
    assert {n: p.shape for n, p in twin.named_parameters()} == {
        n: p.shape for n, p in _lm().named_parameters()}
    assert estimate_memory(twin, _sample(4), strategy="fsdp", world_size=2) == estimate_memory(
        _lm(), _sample(4), strategy="fsdp", world_size=2)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_estimate_names_the_devices_that_ran(strategy: str) -> None:
    """Under ddp/fsdp on CPU the estimate's rows are the ranks' cpu devices, not the
    estimator's default cuda:0, cuda:1."""
    task = user_task(BNConvNet, ImageDataset(8), loss=nn.CrossEntropyLoss())
    config = TrainConfig(batch_size=4, estimate_memory=True)
    entry = memory_estimate(config, None, task, strategy, 2, "cpu", model=BNConvNet(),
                            devices=["cpu", "cpu"])
    assert entry["source"] == "estimate_memory", entry
    assert entry["devices"] == ["cpu", "cpu"] and entry["comparable"] is False
    cuda = memory_estimate(config, None, task, strategy, 2, "cuda:0", model=BNConvNet(),
                           devices=["cuda:0", "cuda:1"])
    assert cuda["devices"] == ["cuda:0", "cuda:1"] and cuda["comparable"] is True


def test_the_planner_row_of_another_micro_batch_is_not_the_runs_estimate() -> None:
    """--batch-size auto trains another micro-batch than the planner's: its row then
    estimates a step that never ran, and the entry is made again for the trained batch."""
    from types import SimpleNamespace

    row = SimpleNamespace(strategy="single", applicable=True, label="single", micro_batch=8,
                          per_device_bytes=[1 << 20], devices=["cuda:0"])
    plan = SimpleNamespace(chosen=row, candidates=[])
    task = user_task(_lm, TokenDataset(16), name="lm")
    config = TrainConfig(model="fit:lm", data="fit:TokenDataset", batch_size=8)
    same = memory_estimate(config, plan, task, "single", 1, "cpu")
    assert same["source"] == "planner" and same["micro_batch"] == 8
    searched = TrainConfig(model="fit:lm", data="fit:TokenDataset", batch_size=16)
    other = memory_estimate(searched, plan, task, "single", 1, "cpu", model=_lm())
    assert other["source"] != "planner"
    assert other.get("micro_batch") in (None, 16)
