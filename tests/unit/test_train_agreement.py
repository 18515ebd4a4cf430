"""The pieces that replace a per-step collective under DDP: the finite-gradient guard
(one watched element, poisoned by a rank whose loss is non-finite) and the adaptive
agreement period. In-process; the two-rank behaviour is in
tests/distributed/test_train_oom_gloo.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchgpu.accumulate import GradAccumulator
from torchgpu.models import HousingNet
from torchgpu.precision import Precision
from torchgpu.train.agreement import FiniteGuard, NonFiniteGradients, RankAgreement


def _acc(clip_norm: float | None = None) -> tuple[nn.Module, GradAccumulator]:
    torch.manual_seed(0)
    model = HousingNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, GradAccumulator(model, optimizer, 1, precision=Precision("fp32", "cpu"),
                                  clip_norm=clip_norm)


def _loss(model: nn.Module) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 13, generator=g), torch.randn(8, 1, generator=g)
    return nn.functional.mse_loss(model(x), y)


def _snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_guard_lets_finite_steps_through() -> None:
    model, acc = _acc()
    guard = FiniteGuard(acc)
    before = _snapshot(model)
    assert acc.backward(_loss(model)) is True
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    guard.remove()


def test_a_poisoned_loss_stops_the_step_before_the_weights_change() -> None:
    model, acc = _acc()
    guard = FiniteGuard(acc)
    before = _snapshot(model)
    loss = _loss(model) * float("nan")
    with pytest.raises(NonFiniteGradients):
        acc.backward(guard.poison(loss))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    sentinel = model.layer2[0].weight  # the largest first dimension (32)
    assert sentinel.grad is not None and torch.isnan(sentinel.grad).all()
    acc.reset()
    guard.remove()
    assert acc.backward(_loss(model)) is True  # removed: steps again


def test_with_clipping_the_clip_norm_also_catches_non_finite_gradients() -> None:
    model, acc = _acc(clip_norm=1.0)
    guard = FiniteGuard(acc)
    before = _snapshot(model)
    last = list(model.parameters())[-1]
    loss = _loss(model) + last.sum() * float("inf")  # finite sentinel, inf elsewhere
    with pytest.raises(NonFiniteGradients):
        acc.backward(loss)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    guard.remove()


def test_agreement_period_follows_the_step_time_and_grows_at_most_8x() -> None:
    agreement = RankAgreement(2, period_s=0.5, max_every=1000)
    assert agreement.every == 1
    agreement._plan(0.004, 1)  # 4 ms per step: wants 125, grows 8x first
    assert agreement.every == 8
    agreement._plan(0.032, 8)
    assert agreement.every == 64
    agreement._plan(0.256, 64)
    assert agreement.every == 125
    agreement._plan(2.0, 125)  # steps got slower (16 ms): fewer per agreement
    assert agreement.every == 31
    agreement._plan(60.0, 1)  # one step longer than the period: agree every step
    assert agreement.every == 1
    agreement._plan(0.0, 0)  # nothing measured: unchanged
    assert agreement.every == 1
