"""DistributedDataParallel housing: the replacement for the seed's DataParallel example.

One process per GPU (or gloo processes on CPU), started by torchrun:

    torchgpu launch --nproc 2 examples/housing_ddp.py --epochs 40
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import torchgpu
from torchgpu.data import example_data, make_loader, set_epoch
from torchgpu.models import HousingNet


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--size", type=int, default=None)
    args = parser.parse_args()

    device = torchgpu.get_device("auto")  # cuda:LOCAL_RANK under torchrun, else cpu
    with torchgpu.init_distributed(device=device) as env:  # nccl on GPUs, gloo on CPU
        data = example_data("housing", seed=0, size=args.size)
        loader = make_loader(data.train, args.batch_size, shuffle=True, seed=0, dist=env,
                             device=device)  # each rank gets its shard
        torch.manual_seed(0)
        model = torchgpu.wrap_data_parallel(HousingNet().to(device), "ddp", device=device)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        loss_fn = nn.MSELoss()
        for epoch in range(args.epochs):
            set_epoch(loader, epoch)  # a new shuffle each epoch, the same on every rank
            for x, y in torchgpu.Prefetcher(loader, device):
                optimizer.zero_grad(set_to_none=True)
                loss_fn(model(x), y).backward()  # gradients all-reduced here
                optimizer.step()
        if env.is_main:  # only rank 0 reports
            x, y = torchgpu.to_device(data.test.tensors, device)
            with torch.no_grad():  # the unwrapped module: a DDP forward is a collective
                mse = loss_fn(torchgpu.unwrap(model)(x), y).item()  # (buffer broadcast)
            print(f"{env.world_size} processes: test MSE {mse:.3f}, "
                  f"R² {1 - mse / y.var(unbiased=False).item():.3f}")


if __name__ == "__main__":
    main()
