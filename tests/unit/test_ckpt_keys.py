"""Loading weights across wrappers and foreign layouts by key matching: all 25
save/load combinations of plain, DP, DDP, compile and compile(DDP), Lightning,
Fabric, Accelerate, the seeds' module. layout, file types, and the error diff."""

from __future__ import annotations

import pickle
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.procs import free_port
from torchgpu.checkpoint import (
    convert_checkpoint,
    load_checkpoint,
    load_state_dict,
    save_checkpoint,
)
from torchgpu.errors import CheckpointError


class Net(nn.Module):
    def __init__(self, seed: int, hidden: int = 8) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.stem = nn.Linear(4, hidden)
        self.block = nn.Sequential(nn.Linear(hidden, hidden), nn.BatchNorm1d(hidden))
        self.head = nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.block(self.stem(x))))


def _same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


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


WRAPPERS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "plain": lambda m: m,
    "dp": nn.DataParallel,
    "ddp": DistributedDataParallel,
    "compile": torch.compile,
    "compile_ddp": lambda m: torch.compile(DistributedDataParallel(m)),
}


@pytest.mark.slow
@pytest.mark.usefixtures("gloo")
def test_all_25_wrapper_combinations_give_identical_weights(tmp_path: Path) -> None:
    prefixes = {name: next(iter(wrap(Net(0)).state_dict())).removesuffix("stem.weight")
                for name, wrap in WRAPPERS.items()}
    assert prefixes == {"plain": "", "dp": "module.", "ddp": "module.",
                        "compile": "_orig_mod.", "compile_ddp": "_orig_mod.module."}
    checked = 0
    for index, (src_name, src_wrap) in enumerate(WRAPPERS.items()):
        source = Net(seed=10 + index)
        wrapped_source = src_wrap(source)
        ckpt = save_checkpoint(tmp_path / src_name, model=wrapped_source)
        for dst_name, dst_wrap in WRAPPERS.items():
            target = Net(seed=100)
            assert not _same(source, target)
            load_checkpoint(ckpt, model=dst_wrap(target), restore_rng=False)
            assert _same(source, target), (src_name, dst_name)
            # and the raw wrapper state dict, keys as the wrapper wrote them
            target2 = Net(seed=101)
            report = load_state_dict(dst_wrap(target2), wrapped_source.state_dict())
            assert report.exact and _same(source, target2), (src_name, dst_name)
            checked += 1
    assert checked == 25


def test_nested_compile_inside_dp_keys() -> None:
    source = Net(1)
    inner = nn.DataParallel(torch.compile(source))  # module._orig_mod.*
    assert next(iter(inner.state_dict())).startswith("module._orig_mod.")
    target = Net(2)
    load_state_dict(torch.compile(nn.DataParallel(target)), inner.state_dict())
    assert _same(source, target)


def test_seeds_single2parallel_layout_both_ways(tmp_path: Path) -> None:
    source = Net(3)
    # the seeds' _Single2Parallel: name = "module." + k
    converted = OrderedDict(("module." + k, v) for k, v in source.state_dict().items())
    torch.save(converted, tmp_path / "parallel.pth")
    target = Net(4)
    report = load_state_dict(target, tmp_path / "parallel.pth")
    assert _same(source, target) and report.strip == "module." and report.add == ""
    # the other way: plain weights into a DataParallel model
    target_dp = nn.DataParallel(Net(5))
    report = load_state_dict(target_dp, source.state_dict())
    assert report.add == "module." and _same(source, target_dp.module)


def test_lightning_checkpoint_with_attribute_prefix(tmp_path: Path) -> None:
    source = Net(6)
    ckpt = {
        "epoch": 3, "global_step": 120, "pytorch-lightning_version": "2.4.0",
        "state_dict": OrderedDict(("model." + k, v) for k, v in source.state_dict().items()),
        "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}],
        "lr_schedulers": [], "hparams_name": "kwargs",
    }
    torch.save(ckpt, tmp_path / "epoch=3.ckpt")
    target = Net(7)
    report = load_state_dict(target, tmp_path / "epoch=3.ckpt")
    assert _same(source, target)
    assert report.container == "state_dict" and report.strip == "model."

    class LitModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = Net(8)

    lit = LitModule()  # plain weights into a LightningModule-like wrapper
    load_state_dict(lit, source.state_dict())
    assert _same(source, lit.model)


def test_fabric_save_layout(tmp_path: Path) -> None:
    source = Net(9)
    opt = torch.optim.SGD(source.parameters(), lr=0.1, momentum=0.9)
    torch.save({"model": source.state_dict(), "optimizer": opt.state_dict(), "step": 4},
               tmp_path / "fabric.ckpt")
    target = Net(10)
    report = load_state_dict(target, tmp_path / "fabric.ckpt")
    assert _same(source, target) and report.container == "model"


def test_accelerate_save_state_directory(tmp_path: Path) -> None:
    source = Net(11)
    state = tmp_path / "checkpoint_0"
    state.mkdir()
    save_file({k: v.contiguous() for k, v in source.state_dict().items()},
              str(state / "model.safetensors"), metadata={"format": "pt"})
    torch.save({"state": {}, "param_groups": []}, state / "optimizer.bin")
    with (state / "random_states_0.pkl").open("wb") as handle:
        pickle.dump({"step": 0}, handle)
    wrapped = nn.DataParallel(Net(12))
    load_state_dict(wrapped, state)
    assert _same(source, wrapped.module)


@pytest.mark.parametrize("suffix", [".pt", ".pth", ".bin", ".ckpt", ".safetensors"])
def test_paths_of_every_suffix(tmp_path: Path, suffix: str) -> None:
    source = Net(13)
    path = tmp_path / f"weights{suffix}"
    if suffix == ".safetensors":
        save_file(dict(source.state_dict()), str(path))
    else:
        torch.save(source.state_dict(), path)
    target = Net(14)
    load_state_dict(target, path)
    assert _same(source, target)


def test_our_directory_and_run_dir_as_path(tmp_path: Path) -> None:
    source = Net(15)
    save_checkpoint(tmp_path / "run" / "checkpoints" / "step-3", model=source, step=3)
    target = Net(16)
    load_state_dict(target, tmp_path / "run")
    assert _same(source, target)


def test_mismatch_error_shows_keys_shapes_and_closest_mapping() -> None:
    source = {"module." + k: v for k, v in Net(17, hidden=16).state_dict().items()}
    source["module.extra.weight"] = torch.zeros(3)
    with pytest.raises(CheckpointError) as info:
        load_state_dict(Net(18, hidden=8), source)
    text = str(info.value)
    assert "strip 'module.'" in text
    assert "Shape mismatches" in text and "stem.weight checkpoint [16, 4] vs model [8, 4]" in text
    assert "Unexpected in the checkpoint (1): module.extra.weight [3]" in text
    assert "\n" not in text


def test_missing_keys_listed_and_strict_false_loads_what_fits() -> None:
    full = Net(19)
    partial = {k: v for k, v in full.state_dict().items() if not k.startswith("head.")}
    with pytest.raises(CheckpointError, match=r"Missing in the checkpoint \(2\): head\.weight"):
        load_state_dict(Net(20), partial)
    target = Net(20)
    head_before = target.head.weight.clone()
    report = load_state_dict(target, partial, strict=False)
    assert set(report.missing) == {"head.weight", "head.bias"}
    assert torch.equal(target.stem.weight, full.stem.weight)
    assert torch.equal(target.head.weight, head_before)


def test_convert_to_dp_gives_what_the_seeds_load(tmp_path: Path) -> None:
    source = Net(21)
    save_checkpoint(tmp_path / "ck", model=torch.compile(source))
    result = convert_checkpoint(tmp_path / "ck", tmp_path / "dp.pt", to="dp")
    assert result.fmt == "pt" and result.added == "module."
    state = torch.load(tmp_path / "dp.pt", weights_only=True)
    assert all(k.startswith("module.") for k in state)
    dp = nn.DataParallel(Net(22))
    dp.load_state_dict(state)  # plain torch, strict: the seeds' way of loading
    assert _same(source, dp.module)


def test_convert_to_plain_strips_wrappers_and_lightning_prefix(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    source = Net(23)
    lightning = {"pytorch-lightning_version": "2.4.0", "state_dict": {
        "model." + k: v for k, v in source.state_dict().items()}}
    torch.save(lightning, tmp_path / "l.ckpt")
    result = convert_checkpoint(tmp_path / "l.ckpt", tmp_path / "plain.safetensors")
    assert result.stripped == "model." and result.fmt == "safetensors"
    target = Net(24)
    target.load_state_dict(load_file(str(tmp_path / "plain.safetensors")))
    assert _same(source, target)
    with pytest.raises(CheckpointError, match="already exists"):
        convert_checkpoint(tmp_path / "l.ckpt", tmp_path / "plain.safetensors")


def test_convert_keeps_tied_weights_as_full_keys(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(5, 3)
            self.out = nn.Linear(3, 5, bias=False)
            self.out.weight = self.embed.weight

    model = Tied()
    torch.save(nn.DataParallel(model).state_dict(), tmp_path / "t.pt")
    convert_checkpoint(tmp_path / "t.pt", tmp_path / "t.safetensors")
    loaded = load_file(str(tmp_path / "t.safetensors"))
    assert set(loaded) == {"embed.weight", "out.weight"}
    assert torch.equal(loaded["embed.weight"], loaded["out.weight"])
