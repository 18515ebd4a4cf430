"""IndexDtypeCheck: float indices into an embedding fail on fake and meta tensors in every
supported torch (torch 2.11's meta kernel accepts them; 2.13's refuses), worded as the
eager kernel words it, and integer indices pass."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from torchgpu.fake_checks import IndexDtypeCheck

MESSAGE = "Expected tensor for argument #1 'indices'"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool])
def test_float_indices_fail_on_fake_tensors(dtype: torch.dtype) -> None:
    embed = nn.Embedding(10, 4)
    with FakeTensorMode(allow_non_fake_inputs=True), IndexDtypeCheck(), \
            pytest.raises(RuntimeError, match=MESSAGE):
        embed(torch.zeros(2, 3, dtype=dtype))


def test_every_spelling_of_the_lookup_is_checked() -> None:
    weight = torch.randn(10, 4, device="meta")
    floats = torch.empty(2, 3, device="meta")
    calls = [
        lambda: F.embedding(floats, weight),
        lambda: F.embedding(input=floats, weight=weight),
        lambda: torch.embedding(weight, floats),
        lambda: F.embedding_bag(floats, weight),
        lambda: nn.EmbeddingBag(10, 4, device="meta")(floats),
    ]
    with IndexDtypeCheck():
        for call in calls:
            with pytest.raises(RuntimeError, match=MESSAGE):
                call()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_integer_indices_pass(dtype: torch.dtype) -> None:
    embed = nn.Embedding(10, 4)
    with FakeTensorMode(allow_non_fake_inputs=True), IndexDtypeCheck():
        out = embed(torch.zeros(2, 3, dtype=dtype))
    assert out.shape == (2, 3, 4)
    with IndexDtypeCheck():  # real tensors: the same values as without the check
        ids = torch.tensor([[1, 2]], dtype=dtype)
        torch.testing.assert_close(embed(ids), embed.weight[ids])


def test_the_estimator_refuses_float_token_ids() -> None:
    """Where it matters: the estimator's fake forward names the embedding."""
    from torchgpu.memory.estimate import estimate_memory

    model = nn.Sequential(nn.Embedding(100, 8), nn.Flatten(), nn.Linear(8 * 12, 2))
    with pytest.raises(RuntimeError, match=MESSAGE):
        estimate_memory(model, torch.empty(4, 12, device="meta"))
    est = estimate_memory(model, torch.empty(4, 12, dtype=torch.int64, device="meta"))
    assert est.peak_bytes > 0
