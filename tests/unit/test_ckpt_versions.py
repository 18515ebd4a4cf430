"""Old module versions load into every kind of target: a state dict recording version 1
(BatchNorm without ``num_batches_tracked``, a module whose loader upgrades version 1)
loads strictly, its versions reaching torch's version-aware loading, into a plain model,
a split model, a pipeline, and DataParallel / DDP / torch.compile around either --
whatever prefix the source was saved under."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.procs import free_port
from torchgpu.checkpoint import load_state_dict
from torchgpu.errors import CheckpointError
from torchgpu.parallel.model import split_model
from torchgpu.parallel.pipeline import Pipeline


class Versioned(nn.Module):
    """Version 2 added buffer ``count``; its loader supplies 7 only when the metadata
    says version 1 -- so a 7 proves the saved version reached torch's loading."""

    _version = 2

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4))
        self.register_buffer("count", torch.tensor(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str,
                              local_metadata: dict[str, Any], *args: Any) -> None:
        version = local_metadata.get("version")
        if version is not None and version < 2:
            state_dict.setdefault(prefix + "count", torch.tensor(7))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


def _net(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), Versioned(), nn.Linear(4, 2))


def _old(prefix: str) -> OrderedDict[str, Any]:
    """A version-1 state dict of ``_net(1)`` saved under ``prefix``: no
    num_batches_tracked, no count, every module recorded at version 1."""
    source = _net(1)
    source[1].running_mean.fill_(0.5)
    source[2].weight.data.fill_(3.0)
    state = source.state_dict()
    old: OrderedDict[str, Any] = OrderedDict(
        (prefix + k, v.clone()) for k, v in state.items()
        if not k.endswith(("num_batches_tracked", "count")))
    paths = [f"{prefix}{p}".removesuffix(".") for p in state._metadata]  # type: ignore[attr-defined]
    parents = [prefix[:i].removesuffix(".") for i in range(len(prefix)) if prefix[i] == "."]
    old._metadata = OrderedDict(  # type: ignore[attr-defined]
        (p, {"version": 1}) for p in dict.fromkeys(["", *parents, *paths]))
    return old


@pytest.fixture(scope="module")
def gloo() -> Iterator[None]:
    """A single-process gloo group on 127.0.0.1 so DDP can be built in-process."""
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1)
    yield
    if started:
        dist.destroy_process_group()


def _split(net: nn.Sequential) -> nn.Module:
    return split_model(net, ["cpu", "cpu"])


def _pipe(net: nn.Sequential) -> nn.Module:
    return Pipeline(net, ["cpu", "cpu"], chunks=2)


TARGETS: dict[str, Callable[[nn.Sequential], nn.Module]] = {
    "plain": lambda m: m,
    "split_model": _split,
    "Pipeline": _pipe,
    "dp": nn.DataParallel,
    "ddp": DistributedDataParallel,
    "compile": torch.compile,
    "compile(dp)": lambda m: torch.compile(nn.DataParallel(m)),
    "dp(split_model)": lambda m: nn.DataParallel(_split(m)),
    "compile(split_model)": lambda m: torch.compile(_split(m)),
    "ddp(Pipeline)": lambda m: DistributedDataParallel(_pipe(m)),
    "compile(ddp(split_model))": lambda m: torch.compile(DistributedDataParallel(_split(m))),
}


@pytest.mark.usefixtures("gloo")
@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("prefix", ["", "module.", "_orig_mod.", "module._orig_mod.", "model."])
def test_version_1_state_loads_strictly_into_any_target(prefix: str, target: str) -> None:
    net = _net(2)
    report = load_state_dict(TARGETS[target](net), _old(prefix))
    assert report.exact, report
    assert int(net[2].count) == 7  # the version reached the module's own loader
    assert torch.equal(net[2].weight, torch.full((4,), 3.0))
    assert torch.equal(net[1].running_mean, torch.full((4,), 0.5))
    assert torch.equal(net[0].weight, _net(1)[0].weight)


@pytest.mark.usefixtures("gloo")
@pytest.mark.parametrize("target", list(TARGETS))
def test_state_without_metadata_upgrades_batchnorm_like_torch(target: str) -> None:
    """Old torchvision-style files have no _metadata at all: BatchNorm still upgrades (as
    in torch), while a module that needs version 1 recorded reports its key missing."""
    old = OrderedDict(_old(""))  # a plain OrderedDict copy: no _metadata
    net = _net(3)
    with pytest.raises(CheckpointError, match="count") as raised:
        load_state_dict(TARGETS[target](net), old)
    assert "num_batches_tracked" not in str(raised.value)
    bn_only = OrderedDict((k, v) for k, v in old.items() if not k.startswith("2."))
    bn_net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Identity(), nn.Linear(4, 2))
    assert load_state_dict(TARGETS[target](bn_net), bn_only).exact
    assert torch.equal(bn_net[1].running_mean, torch.full((4,), 0.5))
