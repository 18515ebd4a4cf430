"""A sequential model with dropout and BatchNorm, and its data, for the stage-pipeline
tests (``tests.stage_models:dropout_bn`` / ``tests.stage_models:regression``): each stage
draws dropout masks from its own process's random state and keeps BatchNorm running
statistics, both of which a resume must continue exactly."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, TensorDataset


def dropout_bn() -> nn.Sequential:
    """Eight layers: the pipeline cuts them into two stages of four (``--balance 4,4``)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2),
                         nn.Linear(16, 8), nn.ReLU(), nn.Dropout(0.1), nn.Linear(8, 1))


def regression() -> tuple[Dataset[tuple[Tensor, Tensor]], Dataset[tuple[Tensor, Tensor]]]:
    """70 training rows (batches of 8 leave a short last one of 6) and 20 held-out rows."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(90, 6, generator=generator)
    y = x[:, :1] * 2.0 - x[:, 1:2] + 0.1 * torch.randn(90, 1, generator=generator)
    return TensorDataset(x[:70], y[:70]), TensorDataset(x[70:], y[70:])
