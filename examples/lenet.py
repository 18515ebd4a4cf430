"""LeNet-5 on synthetic 28x28 images, with torchgpu's pieces: device choice, mixed
precision and gradient accumulation (4 micro-batches of 32 = one batch of 128).

    python examples/lenet.py --device auto --precision auto
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import torchgpu
from torchgpu.data import example_data, make_loader
from torchgpu.models import LeNet5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precision", default="fp32", help="fp32|bf16|fp16|auto")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--size", type=int, default=None)
    args = parser.parse_args()

    device = torchgpu.get_device(args.device)
    data = example_data("lenet", seed=0, size=args.size)
    loader = make_loader(data.train, 32, shuffle=True, seed=0, device=device)
    torch.manual_seed(0)
    model = LeNet5(num_classes=data.num_outputs).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    precision = torchgpu.Precision(args.precision, device)  # autocast + GradScaler as one
    acc = torchgpu.GradAccumulator(model, optimizer, args.accumulate, precision=precision)
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        for x, y in torchgpu.Prefetcher(loader, device):
            with acc.micro_step(), precision.autocast():
                loss = loss_fn(model(x), y)
            acc.backward(loss)  # steps the optimizer every `accumulate` micro-batches
        acc.flush()  # the epoch's last, partial window
        x, y = torchgpu.to_device(data.test.tensors, device)
        with torch.no_grad(), precision.autocast():
            accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
        print(f"epoch {epoch}: test accuracy {accuracy:.3f} ({precision.mode} on {device})")


if __name__ == "__main__":
    main()
