"""torch/examples' MNIST recipe through torchgpu.fit: the model, data and optimizer are
mnist_original.py's; the loop, the per-epoch StepLR (``lr_schedule="step"``), the
shuffling, evaluation and the run's files are torchgpu's.

    python examples/recipes/mnist_torchgpu.py --epochs 2 --samples 256 --out runs/mnist
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from torchgpu import fit
from torchgpu.train.metrics import Accuracy


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


def train(epochs: int = 2, samples: int = 256, batch_size: int = 64, seed: int = 1,
          out: str | None = None) -> tuple[list[float], nn.Module]:
    """Train; return every step's loss and the trained model."""
    result = fit(Net, mnist_like(samples, 0), eval_data=mnist_like(samples // 4, 1),
                 loss=F.nll_loss, metrics={"accuracy": Accuracy()},
                 optimizer=lambda params: torch.optim.Adadelta(params, lr=1.0),
                 lr_schedule="step", lr_gamma=0.7, epochs=epochs, batch_size=batch_size,
                 seed=seed, out=out, progress="off")
    return result.state.step_losses, result.model


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--out", default=None)
    losses, _ = train(**vars(parser.parse_args()))
    print(f"{len(losses)} steps: first loss {losses[0]:.4f}, last loss {losses[-1]:.4f}")
