"""wrap_data_parallel and unwrap, in one process (the 2-process paths are in
tests/distributed/test_ddp_gloo.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.user_models import InPlaceToLinear
from torchgpu.distributed import free_port
from torchgpu.errors import ConfigError
from torchgpu.parallel.data import (
    DataParallelFallbackWarning,
    find_ddp,
    unwrap,
    wrap_data_parallel,
    wrapper_chain,
)
from torchgpu.train.config import TrainConfig
from torchgpu.train.strategies import REGISTRY


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


def test_ddp_strategy_keeps_a_model_whose_to_returns_nothing(gloo_world_of_one: None) -> None:
    model = InPlaceToLinear(4, 2)
    wrapped, _ = REGISTRY["ddp"].wrap(model, TrainConfig(), None, torch.device("cpu"))  # type: ignore[arg-type]
    assert isinstance(wrapped, DistributedDataParallel) and wrapped.module is model


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


class _NestedTied(nn.Module):
    """A GPT-2 layout: the embedding sits inside a body, the head beside it is tied."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 6))
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.body[0].weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(ids)))


class _RootTied(nn.Module):
    """A parameter on the root itself is shared by a child: the child stays with the root."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(11, 6))
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.table
        self.mid = nn.Linear(6, 6)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.table[ids]))


def _lm() -> nn.Module:
    from tests.user_models import TinyCausalLM

    torch.manual_seed(0)
    return TinyCausalLM(dropout=0.0)


def test_shard_units_keep_tied_parameters_in_one_unit() -> None:
    from torchgpu.parallel.data import shard_units

    lm = _lm()
    assert shard_units(lm) == [[lm.embed, lm.head], [lm.ln_f]]  # blocks: a ModuleList, root
    nested = _NestedTied()
    assert shard_units(nested) == [[nested.body, nested.head], [nested.norm]]
    root = _RootTied()
    assert shard_units(root) == [[root.mid]]
    untied = _model()
    assert shard_units(untied) == [[untied[0]], [untied[2]]]


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module:UserWarning")  # a 3-d Linear's view
@pytest.mark.parametrize("build", [_lm, _NestedTied, _RootTied])
def test_fsdp_trains_tied_models_like_the_plain_model(
    gloo_world_of_one: None, build: type[nn.Module]
) -> None:
    """fully_shard refuses a parameter in two units; tied blocks are sharded together, and
    the full state keeps the tie (one tensor under both names)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from torchgpu.parallel.data import retie

    torch.manual_seed(0)
    plain = build()
    torch.manual_seed(0)
    model = build()
    ids = torch.randint(0, 11, (3, 5))
    batch = {"input_ids": ids, "labels": ids} if hasattr(plain, "blocks") else None

    def loss(m: nn.Module) -> torch.Tensor:
        if batch is not None:
            return m(**batch).loss  # type: ignore[no-any-return]
        return m(ids).square().mean()  # type: ignore[no-any-return]

    expected = loss(plain)
    expected.backward()
    sharded = wrap_data_parallel(model, "fsdp")
    got = loss(sharded)
    got.backward()
    torch.testing.assert_close(got, expected)
    grads = {n: p.grad.full_tensor() for n, p in sharded.named_parameters()}  # type: ignore[union-attr]
    for name, p in plain.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)
    full = get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True))
    state = retie(dict(full), sharded)
    tied = [(a, b) for a, b in [("head.weight", "embed.weight"),
                                ("head.weight", "body.0.weight"),
                                ("head.weight", "table")] if a in state and b in state]
    assert tied and all(state[a] is state[b] for a, b in tied)
