"""The seed's nn.DataParallel housing example, the torchgpu way.

One process splits each batch over every visible GPU (batch 128 -> 2 x 64 on 2 GPUs).
Without GPUs it runs on one device and says so. For real multi-GPU work prefer DDP:
examples/housing_ddp.py.

    python examples/housing_dataparallel.py
    CUDA_VISIBLE_DEVICES=0,1 python examples/housing_dataparallel.py
"""

from __future__ import annotations

import argparse
import warnings

import torch
from torch import nn

import torchgpu
from torchgpu.data import example_data, make_loader
from torchgpu.models import HousingNet


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--size", type=int, default=None)
    args = parser.parse_args()

    device = torchgpu.get_device("auto")
    data = example_data("housing", seed=0, size=args.size)
    loader = make_loader(data.train, args.batch_size, shuffle=True, seed=0, device=device)
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as notes:  # the no-GPU fallback note
        warnings.simplefilter("always")
        model = torchgpu.wrap_data_parallel(HousingNet(13, 16, 32, 1), "dp", device=device,
                                            batch_size=args.batch_size)
    for note in notes:
        print(f"note: {note.message}")
    model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    loss_fn = nn.MSELoss()

    for epoch in range(args.epochs):
        for x, y in torchgpu.Prefetcher(loader, device):
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
        if epoch % 20 == 0 or epoch == args.epochs - 1:
            print(f"epoch {epoch}: train loss {loss.item():.3f}")

    # Saved weights are canonical (no "module." prefix), loadable into a plain HousingNet.
    plain = HousingNet(13, 16, 32, 1)
    plain.load_state_dict(torchgpu.unwrap(model).state_dict())
    x, y = data.test.tensors
    with torch.no_grad():
        mse = loss_fn(plain.to("cpu")(x), y).item()
    print(f"test MSE {mse:.3f}, R² {1 - mse / y.var(unbiased=False).item():.3f}")


if __name__ == "__main__":
    main()
