"""The checkpoint directory format: files, manifest, latest, keep_last, tied weights,
optimizer/scheduler/scaler/RNG round trips, CUDA-saved files on CPU."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from torchgpu.checkpoint import (
    capture_rng_state,
    find_checkpoint,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
    verify_checkpoint,
)
from torchgpu.checkpoint.layout import FORMAT
from torchgpu.errors import CheckpointError


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def _equal_states(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.body = nn.Linear(6, 6)
        self.decoder = nn.Linear(6, 11)
        self.decoder.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(torch.relu(self.body(self.embed(x))))


def test_directory_layout_manifest_and_meta(tmp_path: Path) -> None:
    model = _net(0)
    out = save_checkpoint(tmp_path / "step-00000007", model=model, step=7, epoch=2,
                          meta={"config": {"lr": 0.1, "out": tmp_path}, "strategy": "single"})
    assert out == tmp_path / "step-00000007"
    assert sorted(p.name for p in out.iterdir()) == [
        "manifest.json", "meta.json", "model.safetensors", "state.pt"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["files"]) == {"meta.json", "model.safetensors", "state.pt"}
    for name, info in manifest["files"].items():
        assert info["size_bytes"] == (out / name).stat().st_size
        assert len(info["sha256"]) == 64
    meta = json.loads((out / "meta.json").read_text())
    assert meta["format"] == FORMAT and meta["step"] == 7 and meta["epoch"] == 2
    assert meta["config"] == {"lr": 0.1, "out": str(tmp_path)}
    assert meta["strategy"] == "single" and meta["world_size"] == 1
    assert meta["versions"]["torch"] == torch.__version__
    assert (tmp_path / "latest").read_text().strip() == "step-00000007"
    assert verify_checkpoint(out).keys() == set(manifest["files"])


def test_model_safetensors_has_canonical_keys(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    model = _net(1)
    save_checkpoint(tmp_path / "a", model=nn.DataParallel(model))
    keys = set(load_file(str(tmp_path / "a" / "model.safetensors")))
    assert keys == set(model.state_dict())


def test_round_trip_restores_weights_step_epoch_extra(tmp_path: Path,
                                                       run_device: torch.device) -> None:
    model = _net(2).to(run_device)  # saved from the device, loaded into a model there
    extra = {"sampler": {"epoch": 3, "offset": 40}, "losses": [1.5, 0.5], "gen": torch.arange(3)}
    save_checkpoint(tmp_path / "c", model=model, step=11, epoch=3, extra=extra)
    fresh = _net(3).to(run_device)
    assert not _equal_states(model, fresh)
    loaded = load_checkpoint(tmp_path / "c", model=fresh)
    assert _equal_states(model, fresh)
    assert (loaded.step, loaded.epoch) == (11, 3)
    assert loaded.extra["sampler"] == {"epoch": 3, "offset": 40}
    assert torch.equal(loaded.extra["gen"], torch.arange(3))
    assert loaded.meta["step"] == 11 and loaded.path == tmp_path / "c"


def test_unsafe_extra_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"extra\['loss'\].*numpy"):
        save_checkpoint(tmp_path / "x", model=_net(0), extra={"loss": np.float32(1.0)})
    assert list(tmp_path.iterdir()) == []


def test_reserved_meta_key_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="reserved"):
        save_checkpoint(tmp_path / "x", model=_net(0), meta={"step": 3})


def test_tied_weights_saved_once_and_retied(tmp_path: Path, run_device: torch.device) -> None:
    from safetensors import safe_open

    model = Tied().to(run_device)
    save_checkpoint(tmp_path / "t", model=model)
    with safe_open(str(tmp_path / "t" / "model.safetensors"), framework="pt") as handle:
        stored = set(handle.keys())
        aliases = json.loads(handle.metadata()["torchgpu.aliases"])
    assert len(stored) == len(model.state_dict()) - 1
    assert aliases in ({"decoder.weight": "embed.weight"}, {"embed.weight": "decoder.weight"})
    torch.manual_seed(99)
    fresh = Tied().to(run_device)
    load_checkpoint(tmp_path / "t", model=fresh)
    assert fresh.decoder.weight is fresh.embed.weight
    assert _equal_states(model, fresh)
    x = torch.tensor([[1, 2, 3]], device=run_device)
    assert torch.equal(model(x), fresh(x))


def test_non_tensor_extra_state_round_trips(tmp_path: Path) -> None:
    class WithExtra(nn.Linear):
        def get_extra_state(self) -> dict[str, int]:
            return {"version": self.version}

        def set_extra_state(self, state: dict[str, int]) -> None:
            self.version = state["version"]

    model = WithExtra(2, 2)
    model.version = 7
    save_checkpoint(tmp_path / "e", model=model)
    fresh = WithExtra(2, 2)
    fresh.version = 0
    load_checkpoint(tmp_path / "e", model=fresh)
    assert fresh.version == 7 and torch.equal(fresh.weight, model.weight)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    model.train()
    device = next(model.parameters()).device
    for _ in range(steps):
        x = torch.randn(16, 4, generator=gen).to(device)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_optimizer_and_scheduler_round_trip_exactly(tmp_path: Path, kind: str,
                                                     run_device: torch.device) -> None:
    Built = tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.StepLR]

    def build(seed: int) -> Built:
        model = _net(seed).to(run_device)
        opt: torch.optim.Optimizer = (
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if kind == "sgd"
            else torch.optim.Adam(model.parameters(), lr=0.01))
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    model, opt, sched = build(0)
    for _ in range(3):
        _train(model, opt, 1, seed=1)
        sched.step()
    save_checkpoint(tmp_path / "o", model=model, optimizer=opt, scheduler=sched, step=3)
    model2, opt2, sched2 = build(5)
    load_checkpoint(tmp_path / "o", model=model2, optimizer=opt2, scheduler=sched2)
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    assert s1["state"].keys() == s2["state"].keys() and s1["state"]
    for index, entry in s1["state"].items():
        for name, value in entry.items():
            other = s2["state"][index][name]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other
    assert sched.state_dict() == sched2.state_dict()
    # continuing both gives bitwise-identical weights
    _train(model, opt, 2, seed=4)
    _train(model2, opt2, 2, seed=4)
    assert _equal_states(model, model2)


def test_grad_scaler_state_round_trips_exactly(tmp_path: Path, run_device: torch.device) -> None:
    # the CPU's GradScaler stands in for fp16's on CUDA; on a GPU it is the real one
    scaler = torch.amp.GradScaler(run_device.type, init_scale=2.0**10, growth_interval=10)
    model = _net(0).to(run_device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(5):
        loss = model(torch.randn(8, 4, device=run_device)).sum()
        scaler.scale(loss).backward()
        if step == 1:  # an inf gradient: the scaler must skip and back off
            next(model.parameters()).grad.fill_(float("inf"))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    state = scaler.state_dict()
    assert state["scale"] == 2.0**9 and state["_growth_tracker"] == 3  # backed off, then grew
    save_checkpoint(tmp_path / "s", model=model, optimizer=opt, scaler=scaler)
    fresh = torch.amp.GradScaler(run_device.type)
    other = _net(1).to(run_device)
    load_checkpoint(tmp_path / "s", model=other, optimizer=torch.optim.SGD(
        other.parameters(), lr=0.1), scaler=fresh)
    assert fresh.state_dict() == state


def test_missing_optimizer_state_is_an_error_when_strict(tmp_path: Path) -> None:
    save_checkpoint(tmp_path / "n", model=_net(0))
    model = _net(0)
    with pytest.raises(CheckpointError, match="no optimizer state"):
        load_checkpoint(tmp_path / "n", model=model,
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.warns(UserWarning, match="no optimizer state"):
        load_checkpoint(tmp_path / "n", model=model, strict=False,
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _draw() -> tuple[list[float], list[float], list[float]]:
    return (torch.rand(4).tolist(), [random.random() for _ in range(4)],
            np.random.rand(4).tolist())


def test_rng_capture_restore_round_trip() -> None:
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    random.gauss(0, 1)  # leaves a cached gauss value in python's state
    state = capture_rng_state()
    first = _draw()
    _draw()
    restore_rng_state(state)
    assert _draw() == first


def test_rng_is_restored_by_load_checkpoint_unless_disabled(tmp_path: Path) -> None:
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    save_checkpoint(tmp_path / "r", model=_net(0))
    expected = _draw()
    load_checkpoint(tmp_path / "r", model=_net(0))
    assert _draw() == expected
    load_checkpoint(tmp_path / "r", model=_net(0), restore_rng=False)
    assert _draw() != expected


def test_rng_state_is_weights_only_safe() -> None:
    import io

    buffer = io.BytesIO()
    torch.save(capture_rng_state(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert set(loaded) == {"torch", "cuda", "python", "numpy"}
    assert loaded["cuda"] is None  # CUDA never initialised here
    assert not torch.cuda.is_initialized()


def test_keep_last_prunes_only_older_complete_checkpoints(tmp_path: Path) -> None:
    model = _net(0)
    (tmp_path / "notes").mkdir()  # not a checkpoint: never touched
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path / f"step-{step:08d}", model=model, step=step, keep_last=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["latest", "notes", "step-00000003", "step-00000004"]
    assert find_checkpoint(tmp_path) == tmp_path / "step-00000004"


def test_find_checkpoint_resolves_latest_run_dir_and_fallback(tmp_path: Path) -> None:
    ckpts = tmp_path / "run" / "checkpoints"
    model = _net(0)
    save_checkpoint(ckpts / "step-1", model=model, step=1)
    save_checkpoint(ckpts / "step-2", model=model, step=2)
    assert find_checkpoint(tmp_path / "run") == ckpts / "step-2"
    assert find_checkpoint(ckpts / "step-1") == ckpts / "step-1"
    assert find_checkpoint(tmp_path / "empty") is None
    # latest names a directory whose files were damaged -> newest complete one, warned
    (ckpts / "step-2" / "state.pt").write_bytes(b"short")
    with pytest.warns(UserWarning, match="missing or incomplete"):
        assert find_checkpoint(ckpts) == ckpts / "step-1"
    with pytest.warns(UserWarning):
        loaded = load_checkpoint(ckpts, model=_net(3))
    assert loaded.step == 1


def test_no_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_checkpoint(tmp_path, model=_net(0))


def test_orphan_temporaries_are_ignored_and_cleaned(tmp_path: Path) -> None:
    import socket

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, timeout=30, check=True)
    dead_pid = int(done.stdout)
    orphan = tmp_path / f".step-9.tmp-{socket.gethostname()}-{dead_pid}-0123abcd"
    orphan.mkdir()
    (orphan / "model.safetensors").write_bytes(b"partial")
    (orphan / "manifest.json").write_text('{"files": {}}')
    save_checkpoint(tmp_path / "step-1", model=_net(0), step=1)
    assert not orphan.exists()
    orphan.mkdir()
    (orphan / "manifest.json").write_text('{"files": {}}')
    assert find_checkpoint(tmp_path) == tmp_path / "step-1"
    assert not orphan.exists()


def test_cuda_saved_state_loads_on_cpu_with_map_location(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stand-in for a checkpoint written on cuda:3: every storage in state.pt is tagged
    'cuda:3', exactly as torch.save records GPU tensors."""
    model = _net(0)
    opt = torch.optim.Adam(model.parameters())
    _train(model, opt, 1, seed=0)
    monkeypatch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:3")
    save_checkpoint(tmp_path / "g", model=model, optimizer=opt, extra={"t": torch.ones(2)})
    monkeypatch.undo()
    if not torch.cuda.is_available():  # proves the stand-in really says "cuda"
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(tmp_path / "g" / "state.pt", weights_only=True)
    model2 = _net(1)
    opt2 = torch.optim.Adam(model2.parameters())
    loaded = load_checkpoint(tmp_path / "g", model=model2, optimizer=opt2)
    assert loaded.extra["t"].device.type == "cpu"
    assert _equal_states(model, model2)
    assert all(v.device.type == "cpu" for s in opt2.state.values() for v in s.values())


def test_cuda_rng_states_are_skipped_with_a_warning_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only path")
    state = capture_rng_state()
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8)]
    with pytest.warns(UserWarning, match="CUDA is not available"):
        restore_rng_state(state)
