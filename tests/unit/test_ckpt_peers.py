"""load_state_dict against the semantics PyTorch's and Lightning's own state-dict tests pin
down: DDP ``module.`` prefixes consumed with their ``_metadata``, strict/non-strict missing
and unexpected keys, wrong sizes, old BatchNorm versions (with and without a version),
non-tensor values, custom ``_save_to_state_dict`` modules, shared modules, non-persistent
buffers, a submodule literally named ``module``, wrapper prefixes in any nesting, and a
model with no state at all."""

from __future__ import annotations

from collections import OrderedDict
from copy import deepcopy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from torchgpu.checkpoint import load_checkpoint, load_state_dict, save_checkpoint
from torchgpu.errors import CheckpointError


def _net() -> nn.Module:
    """A shared Linear under two names, a BatchNorm, a nested block, an empty slot."""
    torch.manual_seed(0)
    shared = nn.Linear(5, 5)
    block = nn.Module()
    block.conv1 = nn.Conv2d(3, 3, 3, bias=True)
    block.conv2 = nn.Conv2d(3, 3, 3, bias=False)
    net = nn.Module()
    net.linear1 = shared
    net.linear2 = shared
    net.bn = nn.BatchNorm2d(2)
    net.block = block
    net.add_module("empty", None)
    return net


def _prefixed(state: dict[str, Any], prefix: str) -> OrderedDict[str, Any]:
    """``state`` as a wrapper saves it: every key and metadata path under ``prefix``."""
    out: OrderedDict[str, Any] = OrderedDict((prefix + k, v) for k, v in state.items())
    stem = prefix.removesuffix(".")
    out._metadata = OrderedDict(  # type: ignore[attr-defined]
        ((f"{stem}.{path}" if path else stem), dict(info))
        for path, info in state._metadata.items())  # type: ignore[attr-defined]
    out._metadata[""] = {"version": 1}  # type: ignore[attr-defined]  # the wrapper itself
    return out


@pytest.mark.parametrize("prefix", ["", "module.", "module._orig_mod.", "_orig_mod.module."])
def test_wrapped_state_with_metadata_loads_into_the_plain_model(prefix: str) -> None:
    net = _net()
    state = net.state_dict()
    state.update({"linear1.weight": torch.ones(5, 5),
                  "block.conv1.bias": torch.arange(1, 4, dtype=torch.float32),
                  "bn.running_mean": torch.randn(2)})
    saved = _prefixed(state, prefix) if prefix else state
    report = load_state_dict(net, saved)
    assert report.exact and report.strip == prefix.replace("_orig_mod.", "")  # compile's ignored
    assert torch.equal(net.linear1.weight, torch.ones(5, 5))
    assert net.linear2.weight is net.linear1.weight  # the shared module stays shared
    assert torch.equal(net.block.conv1.bias, torch.arange(1, 4, dtype=torch.float32))
    assert torch.equal(net.bn.running_mean, state["bn.running_mean"])


@pytest.mark.parametrize("extra", ["extra", "extra.param", "linear1.weight.bad_suffix"])
def test_unexpected_key_is_refused_strictly_and_reported_otherwise(extra: str) -> None:
    net = _net()
    state = net.state_dict()
    state[extra] = torch.ones(5)
    with pytest.raises(CheckpointError, match="Unexpected in the checkpoint") as caught:
        load_state_dict(net, state)
    assert extra in str(caught.value)
    report = load_state_dict(net, state, strict=False)
    assert report.unexpected == (extra,) and report.missing == ()


def test_missing_key_is_refused_strictly_and_the_rest_loads_otherwise() -> None:
    net = _net()
    state = net.state_dict()
    del state["block.conv1.weight"]
    state["bn.running_mean"] = torch.full((2,), 7.0)
    with pytest.raises(CheckpointError, match=r"Missing in the checkpoint.*block\.conv1\.weight"):
        load_state_dict(net, state)
    before = net.block.conv1.weight.detach().clone()
    report = load_state_dict(net, state, strict=False)
    assert report.missing == ("block.conv1.weight",)
    assert torch.equal(net.bn.running_mean, torch.full((2,), 7.0))
    assert torch.equal(net.block.conv1.weight, before)


def test_wrong_size_is_refused_strictly_and_never_copied() -> None:
    net = _net()
    state = net.state_dict()
    state["bn.running_mean"] = torch.rand(14, 4)
    shapes = r"bn\.running_mean checkpoint \[14, 4\] vs model \[2\]"
    with pytest.raises(CheckpointError, match=shapes):
        load_state_dict(net, state)
    before = net.bn.running_mean.clone()
    report = load_state_dict(net, state, strict=False)  # the keys that fit, mismatch reported
    assert [m[0] for m in report.mismatched] == ["bn.running_mean"]
    assert torch.equal(net.bn.running_mean, before)


def test_partial_state_with_a_stray_key_updates_only_what_it_names() -> None:
    net = _net()
    old = deepcopy(net.state_dict())
    partial = {"linear1.weight": torch.ones(5, 5), "bn.running_mean": torch.randn(2),
               "nonexistent_key": torch.rand(3)}
    load_state_dict(net, partial, strict=False)
    new = net.state_dict()
    assert torch.equal(new["linear1.weight"], partial["linear1.weight"])
    for key in old:
        if key not in ("linear1.weight", "linear2.weight", "bn.running_mean"):
            assert torch.equal(old[key], new[key]), key


@pytest.mark.parametrize("wrapped", [False, True])
@pytest.mark.parametrize("version", [1, None])
def test_batchnorm_without_num_batches_tracked_loads_like_torch(
    version: int | None, wrapped: bool
) -> None:
    state = nn.BatchNorm2d(3).state_dict()
    del state["num_batches_tracked"]
    if version is None:
        del state._metadata[""]["version"]  # type: ignore[attr-defined]
    else:
        state._metadata[""]["version"] = version  # type: ignore[attr-defined]
    reference = nn.BatchNorm2d(3)
    reference.load_state_dict(deepcopy(state))  # torch upgrades the old layout itself
    fresh = nn.BatchNorm2d(3)
    load_state_dict(fresh, _prefixed(state, "module.") if wrapped else state)
    assert fresh.num_batches_tracked.dtype == torch.long
    assert fresh.num_batches_tracked.item() == reference.num_batches_tracked.item() == 0


def test_batchnorm_state_without_any_metadata_loads_like_torch() -> None:
    bn = nn.BatchNorm1d(3)
    state = {k: v for k, v in bn.state_dict().items() if k != "num_batches_tracked"}
    reference = nn.BatchNorm1d(3)
    reference.load_state_dict(state)  # torch: no version recorded means an old layout
    load_state_dict(bn, state)
    assert bn.num_batches_tracked.item() == reference.num_batches_tracked.item() == 0


@pytest.mark.parametrize("value", [np.random.randn(2, 2), ((1.0, 1.0), (2.0, 2.0))],
                         ids=["numpy", "tuple"])
def test_values_that_are_not_tensors_are_named_not_a_traceback(value: Any) -> None:
    model = nn.Linear(2, 2, bias=False)
    state = {"weight": value, "_pad": torch.zeros(1)}  # still mostly tensors
    with pytest.raises(CheckpointError, match=r"not tensors.*weight \((ndarray|tuple)\)"):
        load_state_dict(model, state, strict=False)


@pytest.mark.parametrize("bad", ["", 2, None, [torch.zeros(1)]])
def test_a_state_that_is_not_a_mapping_or_path_is_refused(bad: Any) -> None:
    with pytest.raises(CheckpointError, match=r"empty|got a"):
        load_state_dict(nn.Linear(1, 1), bad)


class _Custom(nn.Module):
    """Saves its parameter under another name, the way a custom module may."""

    def __init__(self) -> None:
        super().__init__()
        self.param = nn.Parameter(torch.ones(1))
        self.sub = nn.Linear(5, 5)

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        destination[prefix + "serialized"] = self.param.data + 1

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        self.param.data.copy_(state_dict[prefix + "serialized"] - 1)


def test_custom_save_and_load_hooks_round_trip_through_a_wrapper_prefix() -> None:
    source = nn.Sequential(_Custom())
    with torch.no_grad():
        source[0].param[0] = 10
        source[0].sub.weight[0, 0] = 555
    state = source.state_dict()
    assert "0.serialized" in state and "0.param" not in state
    target = nn.Sequential(_Custom())
    load_state_dict(target, _prefixed(state, "module."))
    assert target[0].param.item() == 10 and target[0].sub.weight[0, 0].item() == 555


def test_non_persistent_buffers_are_neither_saved_nor_required(tmp_path: Path) -> None:
    def make() -> nn.Module:
        model = nn.Linear(2, 2)
        model.register_buffer("scratch", torch.full((3,), 9.0), persistent=False)
        model.register_buffer("kept", torch.zeros(2))
        return model

    source = make()
    source.kept.fill_(4.0)
    save_checkpoint(tmp_path / "step-1", model=nn.DataParallel(source), step=1)
    target = make()
    target.scratch.fill_(1.0)
    load_checkpoint(tmp_path, model=target)
    assert torch.equal(target.kept, torch.full((2,), 4.0))
    assert torch.equal(target.scratch, torch.ones(3))  # not in any state dict: untouched


def test_a_submodule_named_module_is_not_mistaken_for_a_wrapper() -> None:
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)

    source, target = Holder(), Holder()
    wrapped = {"module." + k: v for k, v in source.state_dict().items()}  # DDP(Holder)
    assert load_state_dict(target, wrapped).strip == "module."
    assert torch.equal(target.module.weight, source.module.weight)
    plain = Holder()
    assert load_state_dict(plain, source.state_dict()).strip == ""  # its own keys as they are
    assert torch.equal(plain.module.weight, source.module.weight)


@pytest.mark.parametrize("prefix", ["_forward_module.", "_forward_module._orig_mod.",
                                    "model.", "model._orig_mod.module."])
def test_lightning_and_fabric_prefixes_into_any_wrapper(prefix: str) -> None:
    torch.manual_seed(1)
    source = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    checkpoint = {"state_dict": {prefix + k: v for k, v in source.state_dict().items()},
                  "epoch": 3, "global_step": 30}
    target = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    report = load_state_dict(nn.DataParallel(target), checkpoint)
    assert report.exact and report.container == "state_dict"
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value)


def test_a_model_without_state_loads_an_empty_state_and_round_trips(tmp_path: Path) -> None:
    assert load_state_dict(nn.ReLU(), {}).exact
    save_checkpoint(tmp_path / "step-1", model=nn.ReLU(), step=1)
    assert load_checkpoint(tmp_path, model=nn.ReLU()).step == 1
    with pytest.raises(CheckpointError, match="Unexpected"):
        load_state_dict(nn.ReLU(), {"weight": torch.zeros(1)})
