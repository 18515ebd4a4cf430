"""Unpadded shards: every sample once per epoch, rank batches that add up to the
one-process global batches, empty batches with the right shape, and the layout sums."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from torchgpu.data import make_loader, set_epoch
from torchgpu.data.shards import ShardBatches, ShardLayout
from torchgpu.train.strategies.shard import Shard


def _numbers(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n, dtype=torch.float32).reshape(n, 1),
                         torch.arange(n).reshape(n, 1))


@pytest.mark.parametrize(("n", "world", "batch"), [(85, 2, 8), (81, 2, 8), (7, 4, 1),
                                                   (96, 2, 8), (10, 3, 4)])
def test_rank_batches_are_the_one_process_global_batches(n: int, world: int,
                                                         batch: int) -> None:
    one = ShardBatches(n, batch * world, rank=0, world_size=1, seed=5)
    ranks = [ShardBatches(n, batch, rank=r, world_size=world, seed=5) for r in range(world)]
    for sampler in (one, *ranks):
        sampler.set_epoch(3)
    reference = list(one)
    per_rank = [list(s) for s in ranks]
    assert all(len(b) == len(reference) == len(one) for b in per_rank)
    layout = ranks[0].layout
    assert layout.batches == len(reference)
    for index, big in enumerate(reference):
        parts = [per_rank[r][index] for r in range(world)]
        assert sorted(i for part in parts for i in part) == sorted(big)  # same samples
        assert [len(p) for p in parts] == [layout.batch_samples(index, r) for r in range(world)]
        assert layout.global_samples(index) == len(big)
    flat = [i for b in reference for i in b]
    assert sorted(flat) == list(range(n))  # each sample exactly once, no padding


def test_order_matches_distributed_sampler_and_changes_per_epoch() -> None:
    from torch.utils.data.distributed import DistributedSampler

    data = _numbers(40)
    mine = ShardBatches(40, 40, rank=1, world_size=2, seed=9)
    theirs: DistributedSampler[int] = DistributedSampler(data, num_replicas=2, rank=1,
                                                         shuffle=True, seed=9)
    for epoch in (0, 1):
        mine.set_epoch(epoch)
        theirs.set_epoch(epoch)
        assert next(iter(mine)) == list(theirs)  # 40 splits evenly: no padding either way
    mine.set_epoch(0)
    first = list(mine)
    mine.set_epoch(1)
    assert list(mine) != first


def test_empty_last_batch_has_zero_rows_of_the_right_shape() -> None:
    # 9 samples, 2 ranks of batch 2: global batches 4, 4, 1 -> rank 1's last batch is empty.
    data = _numbers(9)
    loader = make_loader(data, 2, shuffle=True, seed=0, dist=Shard(1, 2), pad=False)
    set_epoch(loader, 2)
    batches = list(loader)
    assert [len(x) for x, _ in batches] == [2, 2, 0]
    x, y = batches[-1]
    assert x.shape == (0, 1) and x.dtype == torch.float32
    assert y.shape == (0, 1) and y.dtype == torch.int64
    assert len(loader) == 3
    rank0 = make_loader(data, 2, shuffle=True, seed=0, dist=Shard(0, 2), pad=False)
    set_epoch(rank0, 2)
    seen = [int(v) for xb, _ in (*rank0, *batches) for v in xb.flatten()]
    assert sorted(seen) == list(range(9))


def test_layout_shares_and_loss_weights() -> None:
    layout = ShardLayout(samples=85, world_size=2, batch_size=8)
    assert layout.batches == 6 and layout.first_short == 5
    assert [layout.rank_samples(r) for r in (0, 1)] == [43, 42]
    assert layout.window_share(0, 3) is None  # full batches: equal weights are exact
    assert layout.window_share(3, 3) == pytest.approx((16 + 16 + 5) / 2)
    assert layout.loss_weight(5, 3) == pytest.approx(3 * 2 / 5)
    assert layout.loss_weight(5, 2) == pytest.approx(2 * 2 / 5)
    assert layout.loss_weight(0, 8) == 1.0
    even = ShardLayout(samples=96, world_size=2, batch_size=8)
    assert even.first_short == even.batches == 6


def test_padded_default_is_unchanged() -> None:
    loader = make_loader(_numbers(9), 2, shuffle=True, seed=0, dist=Shard(1, 2))
    assert sum(len(x) for x, _ in loader) == 5  # DistributedSampler pads rank 1 to 5
