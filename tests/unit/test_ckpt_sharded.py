"""Sharded checkpoints (torchgpu.checkpoint.sharded) in one process: the layout, the
manifest, loading into a plain model and optimizer, a failed write, damage found by
`ckpt verify` and the loaders, `ckpt convert` both ways. The 2-process FSDP2 side is in
tests/distributed/test_sharded_gloo.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tests.procs import run_main
from torchgpu.checkpoint import find_checkpoint, load_checkpoint, verify_checkpoint
from torchgpu.checkpoint.sharded import (
    ShardedSaver,
    describe_shards,
    is_sharded,
    load_sharded_states,
    read_sharded_model,
)
from torchgpu.errors import CheckpointCorruptError, CheckpointError, CheckpointWriteError
from torchgpu.train.config import TrainConfig
from torchgpu.train.config_checks import validate


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        model(torch.randn(5, 4, generator=gen)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def _save(directory: Path, model: nn.Module, optim: torch.optim.Optimizer | None,
          step: int, **kw: Any) -> Path:
    return ShardedSaver(rank=0, world=1).save(
        directory / f"step-{step:08d}", model=model, optimizer=optim, step=step, epoch=0,
        extra={"note": "x"}, meta={"strategy": "fsdp"}, **kw)


def test_the_sharded_layout_is_a_complete_verified_checkpoint(tmp_path: Path) -> None:
    model, optim = _trained()
    path = _save(tmp_path, model, optim, 3)
    assert is_sharded(path) and (tmp_path / "latest").read_text().strip() == path.name
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["layout"] == "sharded"
    assert "shards/.metadata" in manifest["files"] and "model.safetensors" not in manifest["files"]
    assert any(n.startswith("shards/") and n.endswith(".distcp") for n in manifest["files"])
    checked = verify_checkpoint(tmp_path)  # through `latest`, like every loader
    assert set(checked) == set(manifest["files"])
    info = describe_shards(path)
    assert info["model_entries"] == 4 and info["optimizer_entries"] > 0
    assert info["world_size"] == 1
    assert json.loads((path / "meta.json").read_text())["layout"] == "sharded"
    assert find_checkpoint(tmp_path) == path
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_loads_into_a_plain_model_and_optimizer_bitwise(tmp_path: Path) -> None:
    model, optim = _trained()
    path = _save(tmp_path, model, optim, 3)
    fresh = _model(seed=1)
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    loaded = load_checkpoint(path, model=fresh, optimizer=fresh_optim)
    assert loaded.step == 3 and loaded.extra == {"note": "x"}
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    want, got = optim.state_dict(), fresh_optim.state_dict()
    assert want["param_groups"] == got["param_groups"]
    for index, state in want["state"].items():
        for key, value in state.items():
            assert torch.equal(value, got["state"][index][key]), (index, key)
    whole = read_sharded_model(path)  # one process gathers every shard
    assert whole.keys() == model.state_dict().keys()
    assert all(torch.equal(whole[k], v) for k, v in model.state_dict().items())


def test_an_optimizer_that_never_stepped_is_left_out_and_stays_fresh(tmp_path: Path) -> None:
    model = _model()
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    path = _save(tmp_path, model, optim, 0)
    assert not optim.state  # saving did not initialise it (Adam's step count)
    assert describe_shards(path)["optimizer_entries"] == 0
    fresh_optim = torch.optim.Adam(_model().parameters(), lr=0.1)
    load_sharded_states(path, _model(), fresh_optim)
    assert not fresh_optim.state


def test_a_model_of_another_shape_is_one_paragraph(tmp_path: Path) -> None:
    model, optim = _trained()
    path = _save(tmp_path, model, optim, 3)
    other = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    with pytest.raises(CheckpointError, match="does not fit the model") as info:
        load_checkpoint(path, model=other)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_a_failed_shard_write_keeps_the_previous_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.checkpoint as dcp

    model, optim = _trained()
    first = _save(tmp_path, model, optim, 3)

    def full_disk(*args: object, **kwargs: object) -> object:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", full_disk)
    with pytest.raises(CheckpointWriteError, match="previous checkpoint is still") as info:
        _save(tmp_path, model, optim, 4)
    assert "No space left" in str(info.value) and "\n" not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", first.name]  # no temporary
    assert find_checkpoint(tmp_path) == first
    verify_checkpoint(first)


def test_a_crash_before_the_commit_leaves_an_orphan_that_is_never_loaded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer that dies after the shards but before the rename (here: the rename
    raises a BaseException no handler catches, as a kill would stop it)."""
    from torchgpu.checkpoint import sharded

    model, optim = _trained()
    first = _save(tmp_path, model, optim, 3)

    class Killed(BaseException):
        pass

    def killed(temp: Path, final: Path) -> None:
        raise Killed

    monkeypatch.setattr(sharded, "_rename_into_place", killed)
    with pytest.raises(Killed):
        _save(tmp_path, model, optim, 4)
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".step-00000004.tmp-")]
    assert len(leftovers) == 1 and (leftovers[0] / "shards" / ".metadata").exists()
    assert find_checkpoint(tmp_path) == first  # latest still names the previous one


def _damaged(tmp_path: Path) -> Path:
    model, optim = _trained()
    return _save(tmp_path, model, optim, 3)


def test_a_flipped_byte_in_a_shard_is_found_before_loading(tmp_path: Path,
                                                           capsys: Any) -> None:
    path = _damaged(tmp_path)
    shard = sorted((path / "shards").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=shard.name):
        load_checkpoint(path, model=_model())
    code, err = run_main(["ckpt", "verify", str(path)], capsys)
    assert code == 1 and shard.name in err and "sha256" in err


def test_missing_shard_metadata_is_named(tmp_path: Path, capsys: Any) -> None:
    path = _damaged(tmp_path)
    (path / "shards" / ".metadata").unlink()
    code, err = run_main(["ckpt", "verify", str(path)], capsys)
    assert code == 1 and ".metadata is listed in the manifest but missing" in err


def test_unreadable_shard_metadata_is_one_paragraph(tmp_path: Path, capsys: Any) -> None:
    """Metadata that matches its manifest (rewritten together) but is not DCP metadata."""
    path = _damaged(tmp_path)
    (path / "shards" / ".metadata").write_bytes(b"not a pickle")
    manifest = json.loads((path / "manifest.json").read_text())
    import hashlib

    manifest["files"]["shards/.metadata"] = {
        "sha256": hashlib.sha256(b"not a pickle").hexdigest(), "size_bytes": 12}
    (path / "manifest.json").write_text(json.dumps(manifest))
    code, err = run_main(["ckpt", "verify", str(path)], capsys)
    assert code == 1 and "cannot be read as torch.distributed.checkpoint metadata" in err
    with pytest.raises(CheckpointCorruptError, match="damaged"):
        load_checkpoint(path, model=_model())


def test_a_manifest_entry_outside_shards_is_refused(tmp_path: Path) -> None:
    path = _damaged(tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["other/x"] = manifest["files"]["state.pt"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointCorruptError, match="not a plain name"):
        verify_checkpoint(path)


def test_ckpt_verify_reports_the_shards(tmp_path: Path, capsys: Any) -> None:
    from torchgpu.cli.main import main

    path = _damaged(tmp_path)
    code = main(["ckpt", "verify", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"ok: {path}" in out and "sharded: 2 shard files" in out
    assert "written by 1 rank(s), 4 model and" in out


def test_ckpt_convert_sharded_to_one_file_and_back(tmp_path: Path, capsys: Any) -> None:
    model, optim = _trained()
    path = _save(tmp_path / "ckpts", model, optim, 3)
    flat = tmp_path / "model.safetensors"
    assert run_main(["ckpt", "convert", str(path), str(flat)], capsys)[0] == 0
    weights = load_file(flat)
    assert weights.keys() == model.state_dict().keys()
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    back = tmp_path / "sharded"
    assert run_main(["ckpt", "convert", str(flat), str(back), "--format", "dcp"], capsys)[0] == 0
    verify_checkpoint(back)
    assert is_sharded(back) and describe_shards(back)["optimizer_entries"] == 0
    fresh = _model(seed=5)
    load_checkpoint(back, model=fresh)
    assert all(torch.equal(a, b) for a, b in zip(
        fresh.state_dict().values(), model.state_dict().values(), strict=True))
    code, err = run_main(["ckpt", "convert", str(flat), str(back), "--format", "dcp"], capsys)
    assert code == 2 and "already exists" in err


def test_fsdp_takes_the_checkpoint_flags() -> None:
    validate(TrainConfig(save_every=5, strategy="fsdp", async_save=True))
    validate(TrainConfig(resume="run", out="run", strategy="fsdp"))


def test_an_fsdp_resume_from_a_single_file_checkpoint_is_refused(tmp_path: Path) -> None:
    from torchgpu.checkpoint import save_checkpoint
    from torchgpu.errors import ResumeError
    from torchgpu.train.checkpoints.run_checkpoints import _refuse_whole

    model, optim = _trained()
    whole = save_checkpoint(tmp_path / "ddp" / "step-00000003", model=model, optimizer=optim,
                            step=3)
    with pytest.raises(ResumeError, match="sharded checkpoints only") as info:
        _refuse_whole(tmp_path / "ddp")
    assert str(whole) in str(info.value) and "\n" not in str(info.value)
    _refuse_whole(_save(tmp_path / "fsdp", model, optim, 3))  # a sharded one is taken
