"""The library's device-sensitive paths on ``run_device`` (tests/conftest.py): the CPU in
the normal suite, a GPU when ``TORCHGPU_TEST_DEVICE=cuda`` (the GPU check's tests part).
Each test compares with a reference computed the plain way on the same device."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from torchgpu import (
    GradAccumulator,
    Pipeline,
    Precision,
    Prefetcher,
    apply_activation_checkpointing,
    check_devices,
    load_checkpoint,
    save_checkpoint,
    split_model,
    to_device,
)


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def same_device(actual: torch.device, expected: torch.device) -> bool:
    return actual.type == expected.type and (expected.index is None
                                             or actual.index == expected.index)


def test_to_device_moves_nested_batches(run_device: torch.device) -> None:
    batch = {"x": torch.ones(2, 3), "pair": (torch.zeros(1), 7), "name": "b"}
    moved = to_device(batch, run_device)
    assert same_device(moved["x"].device, run_device)
    assert same_device(moved["pair"][0].device, run_device)
    assert moved["pair"][1] == 7 and moved["name"] == "b"
    torch.testing.assert_close(moved["x"].cpu(), batch["x"])


def test_prefetcher_yields_every_batch_in_order(run_device: torch.device) -> None:
    batches = [(torch.full((4, 2), float(i)), torch.tensor([i])) for i in range(5)]
    seen = list(Prefetcher(batches, run_device))
    assert len(seen) == 5
    for i, (x, y) in enumerate(seen):
        assert same_device(x.device, run_device) and same_device(y.device, run_device)
        assert float(x.sum()) == 8.0 * i and int(y) == i


def test_check_devices_names_the_models_device(run_device: torch.device) -> None:
    model = mlp().to(run_device)
    found = check_devices(model, torch.ones(2, 16, device=run_device))
    assert same_device(found, run_device)


def test_accumulated_micro_batches_equal_one_batch(run_device: torch.device) -> None:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).to(run_device)
    y = torch.randn(8, 4, generator=torch.Generator().manual_seed(2)).to(run_device)
    ref = mlp().to(run_device)
    acc_model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    nn.functional.mse_loss(ref(x), y).backward()
    ref_opt.step()
    acc = GradAccumulator(acc_model, torch.optim.SGD(acc_model.parameters(), lr=0.1), 4)
    stepped = [acc.backward(nn.functional.mse_loss(acc_model(xs), ys))
               for xs, ys in zip(x.split(2), y.split(2), strict=True)]
    assert stepped == [False, False, False, True]
    for p, q in zip(acc_model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_bf16_autocast_on_the_device(run_device: torch.device) -> None:
    precision = Precision("bf16", run_device)
    model = mlp().to(run_device)
    with precision.autocast():
        out = model(torch.randn(3, 16, device=run_device))
    assert out.dtype == torch.bfloat16


def test_pipeline_on_one_device_twice_matches_the_model(run_device: torch.device) -> None:
    ref = mlp().to(run_device)
    pipe = Pipeline(copy.deepcopy(ref), [run_device, run_device], chunks=3)
    x = torch.randn(10, 16, device=run_device)
    out, expected = pipe(x), ref(x)
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    for p, q in zip(pipe.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad)


def test_split_model_matches_the_model(run_device: torch.device) -> None:
    ref = mlp().to(run_device)
    split = split_model(copy.deepcopy(ref), [run_device, run_device])
    x = torch.randn(5, 16, device=run_device)
    torch.testing.assert_close(split(x), ref(x))


def test_activation_checkpointing_keeps_gradients(run_device: torch.device) -> None:
    ref = mlp().to(run_device)
    ckpt = apply_activation_checkpointing(copy.deepcopy(ref), segments=2)
    x = torch.randn(6, 16, device=run_device)
    ref(x).square().sum().backward()
    ckpt(x).square().sum().backward()
    for p, q in zip(ckpt.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad)


def test_checkpoint_round_trip_onto_the_device(run_device: torch.device,
                                                tmp_path: Path) -> None:
    model = mlp(seed=3).to(run_device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 16, device=run_device)).sum().backward()
    optimizer.step()
    save_checkpoint(tmp_path / "ckpt", model=model, optimizer=optimizer, step=1)
    fresh = mlp(seed=4).to(run_device)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-3)
    load_checkpoint(tmp_path / "ckpt", model=fresh, optimizer=fresh_opt,
                    map_location=run_device)
    for p, q in zip(fresh.parameters(), model.parameters(), strict=True):
        assert same_device(p.device, run_device)
        torch.testing.assert_close(p, q)
    state = next(iter(fresh_opt.state.values()))
    assert same_device(state["exp_avg"].device, run_device)
