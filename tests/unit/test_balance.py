"""Balance solver against brute force; balance errors; size/time balancing."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from torch import nn

from tests.user_models import InPlaceToLinear
from torchgpu.errors import BalanceError
from torchgpu.parallel.balance import (
    balance_by_size,
    balance_by_time,
    block_costs,
    even_balance,
    layer_sizes,
    solve_partition,
    validate_balance,
)


def compositions(n: int, k: int) -> list[list[int]]:
    """All ways to write n as k positive parts (ordered)."""
    out = []
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        out.append([bounds[i + 1] - bounds[i] for i in range(k)])
    return out


@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("k", range(1, 5))
def test_solver_matches_brute_force(n: int, k: int) -> None:
    if k > n:
        with pytest.raises(BalanceError, match=f"cannot split {n} layers into {k} stages"):
            solve_partition([1.0] * n, k)
        return
    rng = random.Random(1000 * n + k)
    cases = [[rng.random() for _ in range(n)] for _ in range(4)]
    cases += [[float(rng.randint(0, 3)) for _ in range(n)] for _ in range(4)]  # ties, zeros
    for costs in cases:
        got = solve_partition(costs, k)
        assert len(got) == k and all(b >= 1 for b in got) and sum(got) == n
        best = min(max(block_costs(costs, c)) for c in compositions(n, k))
        assert math.isclose(max(block_costs(costs, got)), best, rel_tol=1e-12, abs_tol=1e-12)


def test_solver_examples() -> None:
    assert solve_partition([1, 1, 1, 1], 2) == [2, 2]
    assert solve_partition([10, 1, 1, 1], 2) == [1, 3]
    assert solve_partition([1, 1, 1, 9], 2) == [3, 1]
    assert max(block_costs([5, 1, 1, 1, 1, 1, 5], solve_partition([5, 1, 1, 1, 1, 1, 5], 3))) == 5


def test_even_balance() -> None:
    assert even_balance(8, 3) == [3, 3, 2]
    assert even_balance(6, 6) == [1] * 6


@pytest.mark.parametrize(
    ("balance", "layers", "devices", "pattern"),
    [
        ([3, 3], 8, 2, r"covers 6 layers but the model has 8.*try balance=\[4, 4\]"),
        ([3, 0, 5], 8, 3, r"\[3, 0, 5\] has an empty stage.*try balance=\[3, 3, 2\]"),
        ([4, 4], 8, 3, r"has 2 stages but 3 devices.*try balance=\[3, 3, 2\]"),
        ([1, 1, 1, 1], 3, 4, r"4 stages requested but the model has only 3 layers.*at most 3"),
        ([2.5, 5.5], 8, 2, r"must be a list of integers"),
    ],
)
def test_validate_balance_messages(
    balance: list[int], layers: int, devices: int, pattern: str
) -> None:
    with pytest.raises(BalanceError, match=pattern):
        validate_balance(balance, layers, devices)


def test_validate_balance_suggests_by_cost() -> None:
    with pytest.raises(BalanceError, match=r"try balance=\[1, 3\]"):
        validate_balance([2, 3], 4, 2, costs=[10, 1, 1, 1])
    assert validate_balance((2, 2), 4, 2) == [2, 2]


def test_balance_by_size_isolates_the_big_layer() -> None:
    layers = [nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 256), nn.Linear(256, 4)]
    sizes = layer_sizes(layers, param_scale=1.0)
    assert sizes[0] == (16 + 4) * 4  # weights + bias, 4 bytes each
    assert balance_by_size(layers, 2) == [3, 1]


def test_layer_sizes_counts_saved_activations_without_touching_the_model() -> None:
    bn = nn.BatchNorm1d(64)
    layers = [nn.Linear(8, 64), bn, nn.ReLU()]
    sample = torch.randn(32, 8)
    with_act = layer_sizes(layers, sample, param_scale=0.0)
    assert with_act[2] >= 32 * 64 * 4  # ReLU saves its 32x64 float output
    assert with_act[0] >= 32 * 8 * 4  # Linear saves its input
    assert bn.num_batches_tracked.item() == 0 and bn.running_mean.abs().sum() == 0
    assert layers[0].weight.grad is None


def test_layers_whose_to_returns_nothing_are_measured() -> None:
    layers = [InPlaceToLinear(8, 16), nn.ReLU(), InPlaceToLinear(16, 4)]
    sample = torch.randn(4, 8)
    assert layer_sizes(layers, sample, param_scale=1.0)[0] >= (8 * 16 + 16) * 4
    assert len(balance_by_time(layers, 2, sample)) == 2


def test_balance_by_time_puts_the_slow_layer_alone() -> None:
    torch.manual_seed(0)
    # one slow 512x512 matmul first, then five cheap layers: an even split by count is
    # [3, 3]; by time the slow layer gets (almost) a stage of its own.
    layers = [
        nn.Linear(512, 512),
        nn.Linear(512, 4),
        nn.ReLU(),
        nn.Linear(4, 4),
        nn.ReLU(),
        nn.Linear(4, 4),
    ]
    sample = torch.randn(64, 512)
    balance = balance_by_time(layers, 2, sample, runs=3)
    assert balance in ([1, 5], [2, 4])
    assert all(p.grad is None for layer in layers for p in layer.parameters())
