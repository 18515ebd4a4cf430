"""wrap_data_parallel and unwrap, in one process (the 2-process paths are in
tests/distributed/test_ddp_gloo.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchgpu.distributed import free_port
from torchgpu.errors import ConfigError
from torchgpu.parallel.data import (
    DataParallelFallbackWarning,
    find_ddp,
    unwrap,
    wrap_data_parallel,
    wrapper_chain,
)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def test_dp_without_gpus_falls_back_with_a_note(no_gpu: None) -> None:
    model = _model()
    with pytest.warns(DataParallelFallbackWarning) as record:
        wrapped = wrap_data_parallel(model, "dp", batch_size=1)
    assert wrapped is model
    message = str(record[0].message)
    assert "falling back to one device" in message and "no CUDA GPU" in message
    assert record[0].filename == __file__  # points at the caller, not at torchgpu


def test_dp_on_cpu_device_falls_back_too() -> None:
    model = _model()
    with pytest.warns(DataParallelFallbackWarning, match=r"device cpu was chosen"):
        assert wrap_data_parallel(model, "DP", device="cpu") is model


def test_dp_batch_smaller_than_gpu_count_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    model = _model()
    with pytest.raises(ConfigError) as info:
        wrap_data_parallel(model, "dp", batch_size=3)
    message = str(info.value)
    assert "batch size 3" in message and "4 GPUs" in message and ">= 4" in message
    assert next(model.parameters()).device.type == "cpu"  # nothing moved before the check


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_ddp_and_fsdp_need_a_process_group(mode: str) -> None:
    assert not dist.is_initialized()
    with pytest.raises(ConfigError) as info:
        wrap_data_parallel(_model(), mode)
    assert "process group" in str(info.value) and "torchrun" in str(info.value)


def test_unknown_mode_lists_the_modes() -> None:
    with pytest.raises(ConfigError, match=r"'pipeline'.*dp, ddp, fsdp"):
        wrap_data_parallel(_model(), "pipeline")


@pytest.fixture
def gloo_world_of_one(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ddp_on_cpu_has_no_device_ids(gloo_world_of_one: None) -> None:
    model = _model()
    ddp = wrap_data_parallel(model, "ddp")
    assert isinstance(ddp, DistributedDataParallel)
    assert ddp.device_ids is None and ddp.module is model
    x = torch.randn(3, 4)
    assert torch.equal(ddp(x), model(x))
    assert unwrap(ddp) is model and find_ddp(ddp) is ddp


def test_fsdp_shards_blocks_then_root(gloo_world_of_one: None) -> None:
    from torch.distributed.fsdp import FSDPModule

    model = _model()
    x = torch.randn(3, 4)
    expected = model(x)
    sharded = wrap_data_parallel(model, "fsdp")
    assert sharded is model and unwrap(sharded) is model
    assert isinstance(model, FSDPModule) and isinstance(model[0], FSDPModule)
    assert not isinstance(model[1], FSDPModule)  # ReLU has no parameters
    assert torch.allclose(sharded(x), expected)
    assert list(model.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile imports torch.jit
def test_unwrap_peels_nested_wrappers(gloo_world_of_one: None) -> None:
    model = _model()
    dp = nn.DataParallel(model)  # no GPUs: a wrapper that just holds the module
    compiled = torch.compile(model)
    ddp = DistributedDataParallel(model)
    compiled_ddp = torch.compile(ddp)
    assert unwrap(model) is model
    assert unwrap(dp) is model and unwrap(compiled) is model and unwrap(ddp) is model
    assert unwrap(compiled_ddp) is model
    assert unwrap(nn.DataParallel(torch.compile(model))) is model
    assert list(wrapper_chain(compiled_ddp)) == [compiled_ddp, ddp, model]
    assert find_ddp(compiled_ddp) is ddp and find_ddp(dp) is None
    # a plain module that merely has a child called "module" is not a wrapper
    holder = nn.Module()
    holder.module = model
    assert unwrap(holder) is holder
