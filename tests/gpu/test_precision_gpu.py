"""Precision on a real CUDA GPU: bf16/fp16 autocast, GradScaler skip on inf, and
accumulation under fp16. CPU stand-ins live in tests/unit/test_precision.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchgpu.accumulate import GradAccumulator
from torchgpu.precision import Precision

pytestmark = pytest.mark.gpu


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).cuda()


@pytest.mark.parametrize(("mode", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_autocast_dtype_on_cuda(mode: str, dtype: torch.dtype) -> None:
    if mode == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    prec = Precision(mode, "cuda")
    assert prec.dtype == dtype and (prec.scaler is not None) == (mode == "fp16")
    with prec.autocast():
        out = _model()(torch.randn(4, 16, device="cuda"))
    assert out.dtype == dtype


def test_auto_picks_bf16_where_supported() -> None:
    expected = "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp32"
    assert Precision("auto", "cuda").mode == expected


def test_fp16_scaler_skips_inf_and_steps_otherwise() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prec = Precision("fp16", "cuda")
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(4, 16, device="cuda")
    with prec.autocast():
        loss = model(x * float("inf")).float().sum()
    prec.backward(loss)
    assert prec.step(opt) is False
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    opt.zero_grad()
    with prec.autocast():
        loss = model(x).float().square().mean()
    prec.backward(loss)
    assert prec.step(opt) is True
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_fp16_accumulation_is_close_to_fp32_big_batch() -> None:
    x = torch.randn(32, 16, device="cuda")
    y = torch.randn(32, 1, device="cuda")
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    nn.functional.mse_loss(ref(x), y).backward()
    ref_opt.step()

    model = _model()
    prec = Precision("fp16", "cuda")
    acc = GradAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), 4, precision=prec)
    for xs, ys in zip(x.split(8), y.split(8), strict=True):
        with acc.micro_step(), prec.autocast():
            loss = nn.functional.mse_loss(model(xs).float(), ys)
        acc.backward(loss)
    assert acc.optimizer_steps == 1 and acc.skipped_steps == 0
    pairs = zip(ref.parameters(), model.parameters(), strict=True)
    diff = max((p - q).abs().max().item() for p, q in pairs)
    assert diff < 1e-2
