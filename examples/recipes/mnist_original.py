"""torch/examples' MNIST recipe (mnist/main.py) as its plain PyTorch loop, at a CPU size:
the same Net, log_softmax + nll_loss, Adadelta(lr=1.0), StepLR(step_size=1, gamma=0.7)
stepped per epoch, dropout, seed 1. The data are MNIST-shaped random images (no
download). The shuffled order is DistributedSampler's (``randperm`` seeded with seed +
epoch), the order torchgpu trains in, so this loop and mnist_torchgpu.py see the same batches.

    python examples/recipes/mnist_original.py --epochs 2 --samples 256
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def mnist_like(samples: int, seed: int) -> TensorDataset:
    """``samples`` normalised 1x28x28 images with labels 0-9, the same for a seed."""
    g = torch.Generator().manual_seed(seed)
    images = (torch.rand(samples, 1, 28, 28, generator=g) - 0.1307) / 0.3081
    return TensorDataset(images, torch.randint(0, 10, (samples,), generator=g))


def train(epochs: int = 2, samples: int = 256, batch_size: int = 64,
          seed: int = 1) -> tuple[list[float], nn.Module]:
    """Train; return every step's loss and the trained model."""
    torch.manual_seed(seed)
    model = Net()
    train_data, test_data = mnist_like(samples, 0), mnist_like(samples // 4, 1)
    # One process's DistributedSampler: epoch e's order is randperm(n) seeded with seed + e.
    order = DistributedSampler(train_data, num_replicas=1, rank=0, shuffle=True, seed=seed)
    train_loader = DataLoader(train_data, batch_size=batch_size, sampler=order)
    test_loader = DataLoader(test_data, batch_size=1000)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.7)
    losses = []
    for epoch in range(epochs):
        order.set_epoch(epoch)
        model.train()
        for data, target in train_loader:
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        model.eval()
        test_loss, correct = 0.0, 0
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                correct += int((output.argmax(dim=1) == target).sum())
        print(f"epoch {epoch + 1}: train loss {losses[-1]:.4f}, test loss "
              f"{test_loss / len(test_data):.4f}, accuracy {correct}/{len(test_data)}")
        scheduler.step()
    return losses, model


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=256)
    train(**vars(parser.parse_args()))
