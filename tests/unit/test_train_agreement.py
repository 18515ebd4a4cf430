"""The pieces that replace a per-step collective under DDP: the finite-gradient guard
(one watched element, poisoned by a rank whose loss is non-finite) and the adaptive
agreement period. In-process; the two-rank behaviour is in
tests/distributed/test_train_oom_gloo.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from torchgpu.accumulate import GradAccumulator
from torchgpu.launch.stop_record import StopFlag
from torchgpu.models import HousingNet
from torchgpu.precision import Precision
from torchgpu.train.guards.agreement import FiniteGuard, NonFiniteGradients, RankAgreement
from torchgpu.train.loop.epoch import run_epoch
from torchgpu.train.loop.parts import LoopParts
from torchgpu.train.state import TrainState


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


@pytest.fixture
def gloo_world_of_one(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo group (file store, no network): the agreement's collectives run."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _ddp_parts(agreement: RankAgreement) -> LoopParts:
    torch.manual_seed(0)
    model = HousingNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    precision = Precision("fp32", "cpu")
    acc = GradAccumulator(model, optimizer, 1, precision=precision)
    return LoopParts(model=model, loss_fn=nn.MSELoss(), accumulator=acc,
                     precision=precision, device=torch.device("cpu"), agree=True,
                     agreement=agreement)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 13, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def test_a_stop_agreed_at_the_epoch_end_stops_the_run(gloo_world_of_one: None) -> None:
    """Epochs shorter than the agreement period: the only agreement is the epoch end's,
    so its stop must end the run there, and the next epoch must not start over."""
    agreement = RankAgreement(1, first_every=1000)  # no agreement inside the epoch
    parts = _ddp_parts(agreement)
    state, stop = TrainState(), StopFlag()

    def after_step(s: TrainState) -> None:
        if s.step == 1:
            stop.set("SIGTERM")

    totals = run_epoch(parts, _batches(3), state, batches_per_epoch=3, stop=stop,
                       on_step=after_step)
    assert totals.stopped and state.step == 3 and state.batch_in_epoch == 3
    assert agreement.agreements == 1  # the epoch end's
    assert stop.steps_by_rank == [3] and stop.signal_name == "SIGTERM"
    # The agreed stop is kept: a next epoch stops at its first boundary, collective-free.
    state.begin_epoch(1)
    again = run_epoch(parts, _batches(3), state, batches_per_epoch=3, stop=stop)
    assert again.stopped and state.step == 4 and agreement.agreements == 1


def test_an_agreed_stop_names_the_signalled_rank_on_the_others(
    gloo_world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank whose own flag is clear learns why the ranks stopped and where each was."""
    agreement = RankAgreement(2)
    state, stop = TrainState(step=7), StopFlag()
    agreement.begin(state, [], stop)

    def reduce_as_if_rank_1_was_signalled(buffer: torch.Tensor, op: object = None) -> None:
        buffer[0] += 1.0  # rank 1's stop flag

    def gather_both(out: list[object], mine: object) -> None:
        out[:] = [mine, ("SIGINT", 7)]

    monkeypatch.setattr(dist, "all_reduce", reduce_as_if_rank_1_was_signalled)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "all_gather_object", gather_both)
    assert agreement.agree() is True
    assert stop.is_set() and stop.signal_name == "SIGINT on rank 1"
    assert stop.steps_by_rank == [7, 7]
