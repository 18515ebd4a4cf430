"""Fault injection: SIGKILL in the middle of a save, ENOSPC, damaged files, ranks that
disagree on the step. The previous checkpoint must always stay loadable."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import socket
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


# What both kill scripts do first: a committed step-1, then the model changed in place so
# the interrupted second save of step-1 would differ from it.
CHILD_SETUP = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
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
""")

KILL_SCRIPT = CHILD_SETUP + textwrap.dedent("""
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
    from torchgpu.checkpoint.manifest import is_complete
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


# -- overwriting: a failure or a crash between the two renames (review finding 1) --------


def _fail_rename_into(final_name: str) -> tuple[dict[str, int], object]:
    """An ``os.rename`` that fails the temporary -> ``final_name`` rename with EIO."""
    real_rename = os.rename
    calls = {"refused": 0}

    def rename(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        if Path(dst).name == final_name and Path(src).name.startswith(f".{final_name}.tmp-"):
            calls["refused"] += 1
            raise OSError(errno.EIO, "Input/output error")
        real_rename(src, dst)

    return calls, rename


def test_failed_rename_while_overwriting_puts_the_old_checkpoint_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = _model(0)
    save_checkpoint(tmp_path / "step-1", model=old, step=1)
    calls, failing = _fail_rename_into("step-1")
    with monkeypatch.context() as patch:
        patch.setattr(os, "rename", failing)
        with pytest.raises(CheckpointError, match="Input/output error"):
            save_checkpoint(tmp_path / "step-1", model=_model(1), step=1)
    assert calls["refused"] == 1  # the old one was already moved aside when this failed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-1"]
    assert find_checkpoint(tmp_path) == tmp_path / "step-1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-1"]
    model = _model(3)
    load_checkpoint(tmp_path, model=model)
    assert _same(model, old)


def test_orphan_moved_aside_copy_is_restored_when_its_name_is_free(tmp_path: Path) -> None:
    """What a writer killed between the two renames leaves: the old checkpoint only under
    ``.NAME.old-HOST-PID-RAND``. Cleaning orphans renames it back; it deletes it only when
    ``NAME`` holds the replacement."""
    old = _model(0)
    save_checkpoint(tmp_path / "step-1", model=old, step=1)
    host = socket.gethostname()
    aside = tmp_path / f".step-1.old-{host}-999999999-0123abcd"
    os.rename(tmp_path / "step-1", aside)
    assert find_checkpoint(tmp_path) == tmp_path / "step-1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-1"]
    os.rename(tmp_path / "step-1", aside)  # the same, found by naming the checkpoint itself
    assert find_checkpoint(tmp_path / "step-1") == tmp_path / "step-1"
    model = _model(3)
    load_checkpoint(tmp_path / "step-1", model=model)
    assert _same(model, old)
    # Replacement committed before the crash: the moved-aside copy is the stale one.
    stale = tmp_path / f".step-1.old-{host}-999999998-0123abcd"
    shutil.copytree(tmp_path / "step-1", stale)
    assert atomic.clean_orphans(tmp_path) == [stale]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-1"]


RENAME_KILL_SCRIPT = CHILD_SETUP + textwrap.dedent("""
    real_rename = os.rename

    def rename(src, dst):  # SIGKILL after the old one is moved aside, before the new one lands
        if Path(dst).name == "step-1" and Path(src).name.startswith(".step-1.tmp-"):
            print("BETWEEN", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        real_rename(src, dst)

    os.rename = rename
    save_checkpoint(root + "/step-1", model=model, step=1)
    print("FINISHED", flush=True)
""")


def test_sigkill_between_the_renames_of_an_overwrite_keeps_the_old_checkpoint(
    tmp_path: Path,
) -> None:
    script = tmp_path / "writer.py"
    script.write_text(RENAME_KILL_SCRIPT)
    root = tmp_path / "ckpts"
    done = subprocess.run([sys.executable, str(script), str(root)], capture_output=True,
                          text=True, env=child_env(), timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert done.stdout.split() == ["BETWEEN"]
    names = sorted(p.name for p in root.iterdir())
    assert "step-1" not in names and any(n.startswith(".step-1.old-") for n in names), names
    assert find_checkpoint(root) == root / "step-1"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-1"]
    verify_checkpoint(root / "step-1")
    model = _model(5)
    load_checkpoint(root, model=model)
    assert _same(model, _model(0))  # the old weights, not the half-committed new ones


# -- which checkpoint is newest (review finding 2) ----------------------------------------


def test_newest_and_pruning_follow_commit_order_not_the_step(tmp_path: Path) -> None:
    """After a resume from an earlier step, a lower step can be the newer save: keep_last
    keeps the most recent commits, and the fallback for a damaged `latest` is the most
    recently committed complete checkpoint."""
    for step in (10, 20, 5):
        save_checkpoint(tmp_path / f"step-{step}", model=_model(step), step=step, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-20", "step-5"]
    save_checkpoint(tmp_path / "step-7", model=_model(7), step=7)
    (tmp_path / "step-7" / "manifest.json").unlink()
    with pytest.warns(UserWarning, match="'step-5'"):
        assert find_checkpoint(tmp_path) == tmp_path / "step-5"
