"""The seed's housing regression, device-agnostic: the same script on CPU, GPU or MPS.

    python examples/housing_device_agnostic.py --device auto    # cuda:0 if any, else cpu
    python examples/housing_device_agnostic.py --device cuda:1
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import torchgpu
from torchgpu.data import example_data, make_loader
from torchgpu.models import HousingNet


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="auto", help="auto|cpu|cuda|cuda:N|mps")
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--size", type=int, default=None, help="rows of data (default 506)")
    args = parser.parse_args()

    device = torchgpu.get_device(args.device)  # validated: a clear error for cuda:7
    data = example_data("housing", seed=0, size=args.size)  # standardised features
    loader = make_loader(data.train, args.batch_size, shuffle=True, seed=0, device=device)
    torch.manual_seed(0)
    model = HousingNet(13, 16, 32, 1).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    loss_fn = nn.MSELoss()

    for _ in range(args.epochs):
        for x, y in torchgpu.Prefetcher(loader, device):  # batches arrive on `device`
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()

    x, y = torchgpu.to_device(data.test.tensors, device)
    with torch.no_grad():
        mse = loss_fn(model(x), y).item()
    r2 = 1 - mse / y.var(unbiased=False).item()
    print(f"device {device}: test MSE {mse:.3f}, R² {r2:.3f}")


if __name__ == "__main__":
    main()
