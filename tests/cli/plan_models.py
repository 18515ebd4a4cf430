"""Model factories for the `torchgpu plan --model` tests."""

from __future__ import annotations

from torch import nn


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4)
    )


def not_a_model() -> int:
    return 3
