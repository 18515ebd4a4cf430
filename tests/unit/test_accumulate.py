"""GradAccumulator: k micro-batches equal one big batch; boundaries, flush, skips, DDP."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchgpu.accumulate import GradAccumulator
from torchgpu.distributed import free_port
from torchgpu.errors import ConfigError
from torchgpu.precision import Precision

OptFactory = Callable[[nn.Module], torch.optim.Optimizer]
OPTIMIZERS: dict[str, OptFactory] = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
}


def _model(device: torch.device | None = None) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1)).to(device or "cpu")


def _data(rows: int, seed: int = 1, device: torch.device | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(rows, 6, generator=gen), torch.randn(rows, 1, generator=gen)
    return x.to(device or "cpu"), y.to(device or "cpu")


def _big_batch_steps(
    model: nn.Module, opt: torch.optim.Optimizer, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> None:
    for x, y in batches:
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    return max((p - q).abs().max().item() for p, q in pairs)


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_k_micro_batches_equal_one_big_batch(opt_name: str, run_device: torch.device) -> None:
    k, micro = 4, 5
    windows = [_data(k * micro, seed=s, device=run_device) for s in range(3)]
    ref = _model(run_device)
    _big_batch_steps(ref, OPTIMIZERS[opt_name](ref), windows)

    model = _model(run_device)
    acc = GradAccumulator(model, OPTIMIZERS[opt_name](model), steps=k)
    stepped = []
    for x, y in windows:
        for xs, ys in zip(x.split(micro), y.split(micro), strict=True):
            with acc.micro_step():
                stepped.append(acc.backward(nn.functional.mse_loss(model(xs), ys)))
    assert stepped == [False, False, False, True] * 3
    assert acc.optimizer_steps == 3 and acc.pending == 0
    assert _max_diff(ref, model) < 1e-6
    # and it really trained (guards against comparing two untouched models)
    assert _max_diff(_model(run_device), model) > 1e-3


def test_flush_steps_a_partial_window_as_its_mean() -> None:
    k, micro, seen = 4, 3, 3
    x, y = _data(seen * micro)
    ref = _model()
    _big_batch_steps(ref, OPTIMIZERS["adam"](ref), [(x, y)])

    model = _model()
    acc = GradAccumulator(model, OPTIMIZERS["adam"](model), steps=k)
    for xs, ys in zip(x.split(micro), y.split(micro), strict=True):
        with acc.micro_step():
            assert acc.backward(nn.functional.mse_loss(model(xs), ys)) is False
    assert acc.pending == seen
    assert acc.flush() is True
    assert acc.pending == 0 and all(p.grad is None for p in model.parameters())
    assert _max_diff(ref, model) < 1e-6
    assert acc.flush() is False  # nothing pending


def _unequal_micro_batches(x: torch.Tensor, y: torch.Tensor,
                           sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(zip(x.split(sizes), y.split(sizes), strict=True))


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_unequal_micro_batches_weighted_by_samples_equal_one_big_batch(
    opt_name: str, run_device: torch.device
) -> None:
    sizes = [10, 10, 12]
    windows = [_data(sum(sizes), seed=s, device=run_device) for s in range(2)]
    ref = _model(run_device)
    _big_batch_steps(ref, OPTIMIZERS[opt_name](ref), windows)

    def accumulate(weighted: bool) -> nn.Module:
        model = _model(run_device)
        acc = GradAccumulator(model, OPTIMIZERS[opt_name](model), steps=3)
        for x, y in windows:
            if weighted:
                acc.set_steps(3, window_samples=sum(sizes))
            for xs, ys in _unequal_micro_batches(x, y, sizes):
                with acc.micro_step():
                    loss = nn.functional.mse_loss(model(xs), ys)
                    acc.backward(loss, samples=len(xs))
        assert acc.optimizer_steps == 2
        return model

    assert _max_diff(ref, accumulate(weighted=True)) < 1e-6
    # Negative control: equal weights (no window_samples; ``samples`` is then ignored).
    assert _max_diff(ref, accumulate(weighted=False)) > 1e-4


def test_weighted_flush_and_empty_micro_batch() -> None:
    x, y = _data(22)
    ref = _model()
    _big_batch_steps(ref, OPTIMIZERS["sgd"](ref), [(x, y)])

    model = _model()
    acc = GradAccumulator(model, OPTIMIZERS["sgd"](model), steps=4)
    acc.set_steps(4, window_samples=40)  # more than will come: flush rescales to the seen 22
    for xs, ys in (*_unequal_micro_batches(x, y, [8, 14]), (x[:0], y[:0])):
        with acc.micro_step():
            out = model(xs)
            loss = nn.functional.mse_loss(out, ys) if len(xs) else out.sum() * 0.0
            assert acc.backward(loss, samples=len(xs)) is False
    assert acc.loss_scale(8) == pytest.approx(8 / 40) and acc.loss_scale() == 0.25
    assert acc.flush() is True
    assert _max_diff(ref, model) < 1e-6
    assert acc.window_samples == 40.0  # kept until the next set_steps
    acc.set_steps(4)
    assert acc.window_samples is None


@pytest.mark.parametrize("bad", [0, -3.0, float("nan"), float("inf")])
def test_bad_window_samples_are_refused(bad: float) -> None:
    model = _model()
    acc = GradAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)
    with pytest.raises(ConfigError, match="window_samples"):
        acc.set_steps(2, window_samples=bad)


def test_clipping_matches_clipping_the_big_batch(run_device: torch.device) -> None:
    x, y = _data(12, device=run_device)
    y = y * 100.0  # large gradients so clipping bites
    ref = _model(run_device)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    nn.functional.mse_loss(ref(x), y).backward()
    norm = nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    opt.step()
    assert norm > 0.5

    model = _model(run_device)
    acc = GradAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), 3, clip_norm=0.5)
    for xs, ys in zip(x.split(4), y.split(4), strict=True):
        with acc.micro_step():
            acc.backward(nn.functional.mse_loss(model(xs), ys))
    assert acc.last_grad_norm is not None
    assert torch.allclose(acc.last_grad_norm, norm, rtol=1e-5)
    assert _max_diff(ref, model) < 1e-6


def test_scaler_skip_is_counted_and_weights_kept() -> None:
    model = _model()
    before = copy.deepcopy(model)
    prec = Precision("fp32")
    prec.scaler = torch.amp.GradScaler("cpu")  # CPU stand-in for fp16 on CUDA
    acc = GradAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), 2, precision=prec)
    x, y = _data(4)
    results = []
    for xs in (x[:2], torch.full((2, 6), float("inf"))):
        with acc.micro_step():
            results.append(acc.backward(nn.functional.mse_loss(model(xs), y[:2])))
    assert results == [False, False]
    assert acc.skipped_steps == 1 and acc.optimizer_steps == 0 and acc.pending == 0
    assert _max_diff(before, model) == 0.0
    assert all(p.grad is None for p in model.parameters())


def test_steps_one_is_a_plain_step_each_time() -> None:
    x, y = _data(8)
    ref = _model()
    _big_batch_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1), [(x, y)])
    model = _model()
    acc = GradAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), 1)
    with acc.micro_step() as boundary:
        assert boundary is True
        assert acc.backward(nn.functional.mse_loss(model(x), y)) is True
    assert _max_diff(ref, model) == 0.0


def test_set_steps_only_between_windows_and_reset() -> None:
    model = _model()
    acc = GradAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), 3)
    x, y = _data(2)
    with acc.micro_step() as boundary:
        assert boundary is False
        acc.backward(nn.functional.mse_loss(model(x), y))
    with pytest.raises(ConfigError, match="1 of 3"):
        acc.set_steps(2)
    acc.reset()
    assert acc.pending == 0 and all(p.grad is None for p in model.parameters())
    acc.set_steps(2)
    assert acc.steps == 2


@pytest.mark.parametrize("steps", [0, -1, 1.5, True, "2"])
def test_bad_steps_are_refused(steps: object) -> None:
    model = _model()
    with pytest.raises(ConfigError, match=repr(steps).replace("(", r"\(")):
        GradAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps)  # type: ignore[arg-type]


@pytest.mark.parametrize("clip", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_clip_norm_is_refused(clip: float) -> None:
    model = _model()
    with pytest.raises(ConfigError, match="clip_norm"):
        GradAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), 2, clip_norm=clip)


@pytest.fixture
def gloo_world_of_one(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ddp_all_reduces_only_at_boundaries(gloo_world_of_one: None) -> None:
    k = 3
    ddp = DistributedDataParallel(_model())
    calls = {"n": 0}

    # Unannotated on purpose: DDP checks a hook's annotations at run time, and
    # `from __future__ import annotations` turns them into strings it rejects.
    def counting_hook(state, bucket):  # type: ignore[no-untyped-def]
        state["n"] += 1
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    ddp.register_comm_hook(calls, counting_hook)
    acc = GradAccumulator(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), k)
    x, y = _data(4 * k * 2 + 8)
    micro_batches = list(zip(x.split(4), y.split(4), strict=True))  # 2 windows + 2 extra
    for xs, ys in micro_batches:
        with acc.micro_step():
            acc.backward(nn.functional.mse_loss(ddp(xs), ys))
    assert calls["n"] == 2  # one all-reduce per closed window, none for the 6 others
    assert acc.pending == 2
    assert acc.flush() is True
    assert calls["n"] == 2  # the flush of a world of one needs no collective


def test_kept_gradients_are_freed_by_zero_grad_and_never_leak_into_the_next_window() -> None:
    """zero_after_step=False (the training loop's order: zero_grad just before the next
    forward) steps exactly as the default; a backward on kept gradients zeroes them."""
    x, y = _data(8)
    ref = _model()
    _big_batch_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1), [(x, y), (x, y)])
    model = _model()
    acc = GradAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), 1,
                          zero_after_step=False)
    assert acc.backward(nn.functional.mse_loss(model(x), y)) is True
    assert all(p.grad is not None for p in model.parameters())  # kept after the step
    assert acc.backward(nn.functional.mse_loss(model(x), y)) is True  # no zero_grad call
    assert _max_diff(ref, model) == 0.0  # the first step's gradients did not add up
    acc.zero_grad()
    assert all(p.grad is None for p in model.parameters())
