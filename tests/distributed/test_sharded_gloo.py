"""Sharded checkpoints of an FSDP2 model on 2 gloo processes (127.0.0.1): every rank
writes its shards, the checkpoint loads back bitwise on 2 ranks and on 1 process (and one
written by 1 process loads on 2), an async save is the state of its step although training
goes on, and a write that fails or a rank that dies mid-save leaves the previous
checkpoint the newest good one. Worker: sharded_worker.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.sharded_worker import make_model, same
from tests.procs import REPO, run_torchrun
from torchgpu.checkpoint import find_checkpoint, load_checkpoint, verify_checkpoint
from torchgpu.checkpoint.sharded import describe_shards, read_sharded_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
WORKER = REPO / "tests" / "distributed" / "sharded_worker.py"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_fsdp2_sharded_round_trip_on_two_ranks_and_on_one(tmp_path: Path, mode: str) -> None:
    done = run_torchrun(WORKER, 2, ["roundtrip", str(tmp_path),
                                    *(["--async"] if mode == "async" else [])])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0 loaded ok" in done.stdout and "rank 1 loaded ok" in done.stdout
    for step in (2, 3):
        path = tmp_path / "ckpts" / f"step-{step:08d}"
        verify_checkpoint(path)
        shards = describe_shards(path)
        assert shards["world_size"] == 2 and shards["shard_files"] == 3  # 2 ranks + metadata
        expected = torch.load(tmp_path / f"expected-{step}.pt", weights_only=False)
        # the state of its step, although step 4 changed the model while it was written
        same(read_sharded_model(path), expected["model"])
        model = make_model()  # one process, no process group: re-sharded on load
        optim = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.1)
        load_checkpoint(path, model=model, optimizer=optim)
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(model, optim)
        same(model_state, expected["model"])
        same(optim_state, expected["optim"])


def test_a_checkpoint_of_one_process_loads_on_two(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tests.distributed.sharded_worker import train_step
    from torchgpu.checkpoint.sharded import ShardedSaver

    model = make_model()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in (1, 2, 3):
        train_step(model, optim, step, 0)
    ShardedSaver(rank=0, world=1).save(tmp_path / "one" / "step-00000003", model=model,
                                       optimizer=optim, step=3, epoch=0)
    model_state, optim_state = get_state_dict(model, optim)
    torch.save({"model": model_state, "optim": optim_state}, tmp_path / "one-expected.pt")
    done = run_torchrun(WORKER, 2, ["load1", str(tmp_path)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("loaded ok") == 2


def test_a_failed_shard_write_on_one_rank_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    done = run_torchrun(WORKER, 2, ["fail", str(tmp_path)])
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):  # both ranks got the one-paragraph error naming rank 1's failure
        assert f"rank {rank} failed ok: writing the sharded checkpoint" in done.stdout
    assert "rank 1: OSError: [Errno 28]" in done.stdout
    ckpts = tmp_path / "ckpts"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-00000001"]
    assert find_checkpoint(ckpts) == ckpts / "step-00000001"
    verify_checkpoint(ckpts)


def test_a_rank_killed_mid_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    done = run_torchrun(WORKER, 2, ["kill", str(tmp_path)])
    assert done.returncode != 0  # rank 1 died; torchrun ended the group
    ckpts = tmp_path / "ckpts"
    assert (ckpts / "latest").read_text().strip() == "step-00000001"
    assert not (ckpts / "step-00000002").exists()
    assert find_checkpoint(ckpts) == ckpts / "step-00000001"  # cleans a dead writer's temporary
    assert [p.name for p in ckpts.iterdir() if p.name.startswith(".")] == []
    verify_checkpoint(ckpts)
