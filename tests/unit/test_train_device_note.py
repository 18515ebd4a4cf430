"""`torchgpu train` says which device it chose and why, without starting CUDA."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torchgpu.train.config import TrainConfig
from torchgpu.train.strategies import placing as build


def test_auto_on_cpu_names_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHGPU_DEVICE", raising=False)
    monkeypatch.setattr("torchgpu.devices.cuda_unavailable_reason", lambda: "no driver here")
    note = build.device_note(TrainConfig(), torch.device("cpu"))
    assert note == "device: cpu (no usable CUDA GPU: no driver here)"
    assert not torch.cuda.is_initialized()


def test_named_device_and_variable_are_credited(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHGPU_DEVICE", raising=False)
    named = dataclasses.replace(TrainConfig(), device="cpu")
    assert build.device_note(named, torch.device("cpu")) == "device: cpu (--device cpu)"
    monkeypatch.setenv("TORCHGPU_DEVICE", "cpu")
    assert "TORCHGPU_DEVICE=cpu" in build.device_note(TrainConfig(), torch.device("cpu"))


def test_split_strategies_name_their_devices() -> None:
    config = dataclasses.replace(TrainConfig(), strategy="pipeline", devices="cpu,cpu")
    assert build.device_note(config, torch.device("cpu")) == "device: stages on cpu,cpu (--devices)"
