"""LeNet-5 for 1x28x28 images (MNIST-shaped), with ReLU and max pooling.

conv 5x5 (pad 2) 1->6, pool -> 6x14x14; conv 5x5 6->16, pool -> 16x5x5;
fully connected 400 -> 120 -> 84 -> ``num_classes``. 61,706 parameters at 10 classes.
"""

from __future__ import annotations

import torch
from torch import nn


class LeNet5(nn.Module):
    """LeNet-5; input ``(N, 1, 28, 28)``, output logits ``(N, num_classes)``."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, kernel_size=5, padding=2)
        self.relu1 = nn.ReLU()
        self.pool1 = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(6, 16, kernel_size=5)
        self.relu2 = nn.ReLU()
        self.pool2 = nn.MaxPool2d(2)
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.relu3 = nn.ReLU()
        self.fc2 = nn.Linear(120, 84)
        self.relu4 = nn.ReLU()
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.children():
            x = layer(x)
        return x

    def as_sequential(self) -> nn.Sequential:
        """All layers in order as one ``nn.Sequential`` sharing this model's modules."""
        return nn.Sequential(*self.children())
