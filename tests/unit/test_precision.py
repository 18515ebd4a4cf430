"""Precision: mode resolution, autocast, scaler skip detection, state round trip."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchgpu.errors import ConfigError
from torchgpu.precision import MODES, Precision, resolve_mode


def test_fp32_has_no_autocast_and_no_scaler() -> None:
    prec = Precision()
    assert (prec.mode, prec.dtype, prec.scaler) == ("fp32", None, None)
    with prec.autocast():
        out = nn.Linear(4, 2)(torch.randn(3, 4))
    assert out.dtype == torch.float32


def test_bf16_on_cpu_autocasts_to_bfloat16() -> None:
    prec = Precision("bf16", "cpu")
    assert prec.dtype == torch.bfloat16 and prec.scaler is None
    with prec.autocast():
        out = nn.Linear(4, 2)(torch.randn(3, 4))
    assert out.dtype == torch.bfloat16
    # outside the context, nothing is cast
    assert nn.Linear(4, 2)(torch.randn(3, 4)).dtype == torch.float32


def test_fp16_on_cpu_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError) as info:
        Precision("fp16", "cpu")
    message = str(info.value)
    assert "fp16" in message and "cpu" in message and "bf16" in message


@pytest.mark.parametrize("mode", ["fp8", "", "float32", "half"])
def test_unknown_mode_lists_the_modes(mode: str) -> None:
    with pytest.raises(ConfigError) as info:
        Precision(mode)
    for name in MODES:
        assert name in str(info.value)
    assert repr(mode) in str(info.value)


def test_bad_device_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="gpu0"):
        Precision("fp32", "gpu0")


def test_auto_is_fp32_on_cpu_and_never_touches_cuda() -> None:
    assert Precision("auto", "cpu").mode == "fp32"
    assert Precision("AUTO", torch.device("cpu")).mode == "fp32"
    assert not torch.cuda.is_initialized()


def test_auto_on_cuda_follows_bf16_support(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert resolve_mode("auto", "cuda:0") == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert resolve_mode("auto", "cuda:0") == "fp32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_mode("auto", "cuda") == "fp32"


def test_fp16_resolves_on_cuda_without_touching_the_gpu() -> None:
    # resolution is pure: only constructing the scaler needs CUDA
    assert resolve_mode("fp16", "cuda:1") == "fp16"
    assert resolve_mode("bf16", "cuda") == "bf16"


def _model_and_opt(device: torch.device | None = None) -> tuple[nn.Linear, torch.optim.SGD]:
    torch.manual_seed(0)
    model = nn.Linear(3, 1).to(device or "cpu")
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_fp32_step_applies_and_returns_true(run_device: torch.device) -> None:
    model, opt = _model_and_opt(run_device)
    before = model.weight.detach().clone()
    prec = Precision("fp32", run_device)
    prec.backward(model(torch.randn(4, 3, device=run_device)).square().mean())
    prec.unscale_(opt)  # no-op without a scaler
    assert prec.step(opt) is True
    assert not torch.equal(before, model.weight)


def _with_scaler(device: torch.device | None = None) -> Precision:
    """fp16's loss scaling on ``device``: on CUDA the real fp16 mode (its GradScaler
    started at 1024 to keep the numbers below); on the CPU, which has no fp16 training,
    a stand-in: the same GradScaler logic on a CPU scaler."""
    device = device or torch.device("cpu")
    prec = Precision("fp16", device) if device.type == "cuda" else Precision("fp32")
    prec.scaler = torch.amp.GradScaler(device.type, init_scale=1024.0)
    return prec


def test_scaler_skip_on_inf_returns_false_and_keeps_weights(run_device: torch.device) -> None:
    model, opt = _model_and_opt(run_device)
    prec = _with_scaler(run_device)
    before = model.weight.detach().clone()
    prec.backward(model(torch.full((2, 3), float("inf"), device=run_device)).sum())
    assert prec.step(opt) is False
    assert torch.equal(before, model.weight)
    assert prec.scaler is not None and prec.scaler.get_scale() == 512.0
    opt.zero_grad()
    prec.backward(model(torch.ones(2, 3, device=run_device)).sum())
    assert prec.step(opt) is True
    assert not torch.equal(before, model.weight)


def test_scaled_backward_then_unscale_gives_true_gradients(run_device: torch.device) -> None:
    model, opt = _model_and_opt(run_device)
    x = torch.randn(5, 3, device=run_device)
    model(x).sum().backward()
    expected = model.weight.grad.clone()  # type: ignore[union-attr]
    opt.zero_grad()
    prec = _with_scaler(run_device)
    prec.backward(model(x).sum())
    assert torch.allclose(model.weight.grad, expected * 1024.0)  # type: ignore[arg-type]
    prec.unscale_(opt)
    assert torch.allclose(model.weight.grad, expected)  # type: ignore[arg-type]


def test_state_dict_round_trip_restores_the_scale(run_device: torch.device) -> None:
    saved = _with_scaler(run_device)
    assert saved.scaler is not None
    saved.scaler.scale(torch.ones((), device=run_device))  # the scale exists from then on
    saved.scaler.update(new_scale=77.0)
    state = saved.state_dict()
    assert state["mode"] == saved.mode and state["scaler"]["scale"] == 77.0
    fresh = _with_scaler(run_device)
    fresh.load_state_dict(state)
    assert fresh.scaler is not None and fresh.scaler.get_scale() == 77.0
    assert Precision().state_dict() == {"mode": "fp32", "scaler": None}


def test_load_state_dict_from_other_mode_warns_and_ignores_scaler() -> None:
    prec = Precision("bf16")
    with pytest.warns(UserWarning, match="fp16"):
        prec.load_state_dict({"mode": "fp16", "scaler": {"scale": 8.0}})
    with pytest.raises(ConfigError):
        prec.load_state_dict({"scale": 8.0})
