"""Scatter/gather of micro-batches along dim 0."""

from __future__ import annotations

import pytest
import torch

from torchgpu.errors import ConfigError
from torchgpu.parallel.microbatch import batch_size, chunk_sizes, gather, scatter


@pytest.mark.parametrize(
    ("total", "chunks", "sizes"),
    [
        (10, 1, [10]),
        (10, 3, [4, 3, 3]),
        (10, 4, [3, 3, 2, 2]),
        (10, 7, [2, 2, 2, 1, 1, 1, 1]),
        (12, 4, [3, 3, 3, 3]),
        (3, 8, [1, 1, 1]),
        (1, 4, [1]),
    ],
)
def test_chunk_sizes(total: int, chunks: int, sizes: list[int]) -> None:
    assert chunk_sizes(total, chunks) == sizes
    x = torch.arange(total * 2.0).reshape(total, 2)
    parts = scatter(x, chunks)
    assert [p.shape[0] for p in parts] == sizes
    assert torch.equal(gather(parts), x)


def test_tuple_batch_keeps_structure_and_non_tensors() -> None:
    x, y = torch.randn(10, 3), torch.arange(10)
    parts = scatter((x, y, "tag"), 4)
    assert len(parts) == 4 and all(isinstance(p, tuple) and p[2] == "tag" for p in parts)
    assert torch.equal(parts[1][1], torch.tensor([3, 4, 5]))
    back = gather(parts)
    assert isinstance(back, tuple) and torch.equal(back[0], x) and torch.equal(back[1], y)
    assert back[2] == "tag"


def test_scatter_is_a_view_and_keeps_autograd() -> None:
    x = torch.randn(6, 2, requires_grad=True)
    parts = scatter(x, 3)
    gather([p * 2 for p in parts]).sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.full((6, 2), 2.0))


def test_errors() -> None:
    with pytest.raises(ConfigError, match="different batch sizes"):
        batch_size((torch.zeros(3), torch.zeros(4)))
    with pytest.raises(ConfigError, match="0-dimensional"):
        scatter(torch.tensor(1.0), 2)
    with pytest.raises(ConfigError, match="chunks must be a positive integer, got 0"):
        scatter(torch.zeros(4), 0)
    with pytest.raises(ConfigError, match="got tuple"):
        batch_size(("a", "b"))  # type: ignore[arg-type]
