"""The arithmetic of resuming on another number of processes
(torchgpu.train.checkpoints.world_change):
every sample of the epoch is trained exactly once across the change, the accumulation
keeps the effective batch, and what cannot keep it, or keeps the world fixed, is said."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest

from torchgpu.data.shards import ShardBatches
from torchgpu.errors import ResumeError
from torchgpu.train.checkpoints.world_change import WorldChange, at_load, plan
from torchgpu.train.config import TrainConfig
from torchgpu.train.state import TrainState

SAMPLES = 85  # 5 samples in the last global batch of 16: the short tail is crossed


def _batches(world: int, batch: int, epoch: int = 1) -> list[list[list[int]]]:
    """Each rank's batches of the epoch, as the run's loader yields them."""
    out = []
    for rank in range(world):
        sampler = ShardBatches(SAMPLES, batch, rank=rank, world_size=world, seed=3)
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


# (saved world, batch, accumulation) -> (world, batch): the brief's cases and a batch change
@pytest.mark.parametrize(("old", "new"), [
    ((2, 8, 1), (1, 8)), ((1, 8, 2), (2, 8)), ((4, 4, 1), (2, 4)), ((2, 4, 2), (1, 16)),
    ((1, 4, 4), (4, 4))])
def test_every_sample_is_trained_once_across_the_change(
        old: tuple[int, int, int], new: tuple[int, int], tmp_path: Path) -> None:
    (w0, b0, k0), (w1, b1) = old, new
    saved_batches = math.ceil(SAMPLES / (w0 * b0))
    change = plan_for(w0, b0, k0, w1, b1, tmp_path)
    assert change.world * change.batch * change.accumulate == w0 * b0 * k0
    batches = math.ceil(SAMPLES / (w1 * b1))
    before, after = _batches(w0, b0), _batches(w1, b1)
    steps = math.ceil(saved_batches / k0)
    for step in range(steps + 1):  # a save at every optimizer-step boundary of the epoch
        done = min(step * k0, saved_batches)
        state = TrainState(epoch=1, step=6 + step, batch_in_epoch=done, samples=done * b0,
                           epoch_loss_sum=2.0 * done, epoch_loss_count=done,
                           step_losses=[1.0] * (6 + step))
        moved = change.convert(state, saved_batches, batches)
        seen = Counter(i for rank in before for batch in rank[:done] for i in batch)
        seen.update(i for rank in after for batch in rank[moved.batch_in_epoch:]
                    for i in batch)
        assert seen == Counter(range(SAMPLES)), (step, moved.batch_in_epoch)
        # the later windows are the uninterrupted run's optimizer steps
        assert math.ceil((batches - moved.batch_in_epoch) / change.accumulate) == steps - step
        if done:  # the epoch's mean loss so far is kept
            assert moved.epoch_loss_sum / moved.epoch_loss_count == pytest.approx(2.0)


def plan_for(w0: int, b0: int, k0: int, w1: int, b1: int, where: Path,
             strategy: str = "ddp", saved_strategy: str = "ddp") -> WorldChange:
    """The change from a checkpoint (its meta.json written in ``where``) of ``w0`` x
    ``b0`` x ``k0`` onto ``w1`` processes of batch ``b1``."""
    (where / "meta.json").write_text(json.dumps({
        "world_size": w0, "strategy": saved_strategy,
        "config": {"batch_size": b0, "accumulate": k0}}))
    change = plan(where, TrainConfig(example="housing", batch_size=b1), w1, strategy)
    assert change is not None
    return change


def test_a_batch_no_accumulation_keeps_is_refused_naming_the_values(tmp_path: Path) -> None:
    with pytest.raises(ResumeError) as caught:
        plan_for(2, 8, 1, 3, 8, tmp_path)
    text = str(caught.value)
    assert "global batch of 16" in text and "3 process(es) x --batch-size 8 = 24" in text
    assert "--nproc 1 / 2" in text  # worlds that keep it with the saved batch


def test_the_same_world_or_another_strategy_is_no_world_change(tmp_path: Path) -> None:
    (tmp_path / "meta.json").write_text(json.dumps({
        "world_size": 2, "strategy": "fsdp", "config": {"batch_size": 8, "accumulate": 1}}))
    config = TrainConfig(example="housing", batch_size=8)
    assert plan(tmp_path, config, 1, "single") is None  # fsdp's old one-file layout
    assert plan(tmp_path, config, 2, "fsdp") is None
    saved = {"world_size": 2, "batch_size": 8, "accumulate": 1, "batches_per_epoch": 6}
    now = {**saved, "world_size": 1, "accumulate": 2, "batches_per_epoch": 11}
    assert at_load(tmp_path, saved, saved, "ddp", "ddp", False) is None
    assert at_load(tmp_path, saved, now, "pipeline", "single", False) is None
    assert at_load(tmp_path, saved, now, "ddp", "single", False) is not None
    with pytest.raises(ResumeError, match="streamed training set"):
        at_load(tmp_path, saved, now, "ddp", "single", True)
    with pytest.raises(ResumeError, match="global batch of 16"):
        at_load(tmp_path, saved, {**now, "accumulate": 1}, "ddp", "single", False)


def test_fsdp_shards_continue_on_another_world_and_one_file_does_not_go_to_fsdp(
        tmp_path: Path) -> None:
    sharded, whole = tmp_path / "sharded", tmp_path / "whole"
    sharded.mkdir()
    whole.mkdir()
    (sharded / "shards").mkdir()  # the sharded layout: DCP re-shards on load
    change = plan_for(2, 8, 1, 1, 8, sharded, strategy="single", saved_strategy="fsdp")
    assert change.accumulate == 2
    assert plan_for(1, 8, 2, 2, 8, sharded, strategy="fsdp",
                    saved_strategy="single").accumulate == 1  # one fsdp process's shards
    assert plan_for(4, 4, 1, 2, 4, sharded, strategy="ddp",
                    saved_strategy="fsdp").accumulate == 2  # shards load into DDP too
    saved = {"world_size": 2, "batch_size": 8, "accumulate": 1, "batches_per_epoch": 6}
    now = {**saved, "world_size": 1, "accumulate": 2, "batches_per_epoch": 11}
    assert at_load(sharded, saved, now, "fsdp", "single", False) is not None
    with pytest.raises(ResumeError) as caught:  # one file: its optimizer state is whole
        plan_for(2, 8, 1, 4, 4, whole, strategy="fsdp", saved_strategy="ddp")
    text = str(caught.value)
    assert "--strategy fsdp" in text and "saved by 2 process(es) of --strategy ddp" in text
    assert "Resume with --strategy ddp" in text and "torchgpu ckpt convert" in text
    assert "\n" not in text
    with pytest.raises(ResumeError, match="one file"):
        at_load(whole, {**saved, "world_size": 1, "accumulate": 2, "batches_per_epoch": 11},
                {**saved, "world_size": 2}, "single", "fsdp", False)
