"""Fault injection: SIGKILL in the middle of a save, ENOSPC, damaged files, ranks that
disagree on the step. The previous checkpoint must always stay loadable."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import torchgpu.checkpoint.atomic as atomic
from tests.procs import free_port
from tests.procs import test_env as child_env
from torchgpu.checkpoint import (
    find_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from torchgpu.errors import CheckpointCorruptError, CheckpointError


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values(), strict=True))


KILL_SCRIPT = textwrap.dedent("""
    import os, sys, time
    import torch
    from torch import nn
    import torchgpu.checkpoint.atomic as atomic
    from torchgpu.checkpoint import save_checkpoint

    root = sys.argv[1]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    save_checkpoint(root + "/step-1", model=model, step=1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    real_write = os.write

    def slow_write(fd, view):  # the documented fault-injection hook: stall every write
        written = real_write(fd, view[:512])
        print("WRITING", flush=True)
        time.sleep(0.2)
        return written

    atomic._write = slow_write
    save_checkpoint(root + "/step-2", model=model, step=2)
    print("FINISHED", flush=True)
""")


@pytest.mark.slow
def test_sigkill_mid_save_leaves_previous_checkpoint_loadable(tmp_path: Path) -> None:
    script = tmp_path / "writer.py"
    script.write_text(KILL_SCRIPT)
    root = tmp_path / "ckpts"
    proc = subprocess.Popen([sys.executable, str(script), str(root)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until the second save is mid-write
        assert line.strip() == "WRITING", proc.stderr.read() if proc.stderr else line
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not (root / "step-2").exists()  # the final path is never partial
    orphans = [p for p in root.iterdir() if p.name.startswith(".step-2.tmp-")]
    assert len(orphans) == 1 and not (orphans[0] / "manifest.json").exists()
    assert (root / "latest").read_text().strip() == "step-1"
    assert find_checkpoint(root) == root / "step-1"
    assert not orphans[0].exists()  # find_checkpoint cleaned the dead writer's temporary
    verify_checkpoint(root / "step-1")
    model = _model(5)
    loaded = load_checkpoint(root, model=model)
    assert loaded.step == 1 and _same(model, _model(0))


def test_enospc_leaves_old_checkpoint_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = _model(0)
    save_checkpoint(tmp_path / "step-1", model=old, step=1)
    before = sorted(p.name for p in tmp_path.iterdir())
    calls = {"n": 0}

    def full_disk(fd: int, view: memoryview) -> int:
        calls["n"] += 1
        if calls["n"] == 1:  # part of the first file makes it to disk, then the disk is full
            return os.write(fd, view[: len(view) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic, "_write", full_disk)
    with pytest.raises(CheckpointError, match="disk is full"):
        save_checkpoint(tmp_path / "step-2", model=_model(1), step=2)
    assert calls["n"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no temporary, no step-2
    assert (tmp_path / "latest").read_text().strip() == "step-1"
    monkeypatch.undo()
    verify_checkpoint(tmp_path / "step-1")
    model = _model(3)
    load_checkpoint(tmp_path, model=model)
    assert _same(model, old)


def test_enospc_while_overwriting_keeps_the_old_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = _model(0)
    save_checkpoint(tmp_path / "step-1", model=old, step=1)

    def full_disk(fd: int, view: memoryview) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic, "_write", full_disk)
    with pytest.raises(CheckpointError, match="disk is full"):
        save_checkpoint(tmp_path / "step-1", model=_model(1), step=1)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-1"]
    model = _model(3)
    load_checkpoint(tmp_path / "step-1", model=model)
    assert _same(model, old)


def test_overwrite_replaces_a_checkpoint_completely(tmp_path: Path) -> None:
    save_checkpoint(tmp_path / "step-1", model=_model(0), step=1)
    new = _model(1)
    save_checkpoint(tmp_path / "step-1", model=new, step=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-1"]
    model = _model(2)
    load_checkpoint(tmp_path, model=model)
    assert _same(model, new)


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
@pytest.mark.parametrize("name", ["model.safetensors", "state.pt", "meta.json"])
def test_damaged_file_raises_corrupt_error_naming_it(
    tmp_path: Path, damage: str, name: str
) -> None:
    ckpt = save_checkpoint(tmp_path / "c", model=_model(0))
    path = ckpt / name
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        middle = len(data) // 2
        path.write_bytes(data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:])
    else:
        path.unlink()
    with pytest.raises(CheckpointCorruptError, match=name):
        verify_checkpoint(ckpt)
    with pytest.raises(CheckpointCorruptError, match=name):
        load_checkpoint(ckpt, model=_model(1))


def test_missing_manifest_is_incomplete(tmp_path: Path) -> None:
    ckpt = save_checkpoint(tmp_path / "c", model=_model(0))
    (ckpt / "manifest.json").unlink()
    with pytest.raises(CheckpointCorruptError, match=r"manifest\.json is missing"):
        verify_checkpoint(ckpt)
    assert find_checkpoint(tmp_path) is None


DIST_SCRIPT = textwrap.dedent("""
    import os, sys
    from dataclasses import dataclass
    import torch
    import torch.distributed as dist
    from torch import nn
    from torchgpu.checkpoint import save_checkpoint
    from torchgpu.checkpoint.layout import is_complete
    from torchgpu.errors import CheckpointError

    @dataclass(frozen=True)
    class Env:
        rank: int
        world_size: int
        is_distributed: bool = True

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    env = Env(rank, 2)
    root = sys.argv[1]
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    out = save_checkpoint(root + "/step-3", model=model, step=3, dist=env)
    print(f"rank{rank} same complete={is_complete(out)}", flush=True)
    try:
        save_checkpoint(root + f"/step-{4 + rank}", model=model, step=4 + rank, dist=env)
        print(f"rank{rank} saved-differing", flush=True)
    except CheckpointError as error:
        print(f"rank{rank} refused: {error}", flush=True)
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_ddp_ranks_agree_on_step_and_rank0_writes(tmp_path: Path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(DIST_SCRIPT)
    port = str(free_port())
    procs = [subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "ck")], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        env=child_env(RANK=str(r), WORLD_SIZE="2", MASTER_PORT=port)) for r in range(2)]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=90)
            outputs.append(out)
            assert proc.returncode == 0, err[-2000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for rank, out in enumerate(outputs):
        assert f"rank{rank} same complete=True" in out
        assert f"rank{rank} refused: ranks disagree on the step" in out
        assert "span 4..5" in out
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["latest", "step-3"]
