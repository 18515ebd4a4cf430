"""The multi-process pipeline demo: train a small seeded MLP with
:class:`torchgpu.parallel.stages.StagePipeline` and save what each rank holds, so a
test (or a person) can compare it with the one-process model. Under torchrun::

    torchrun --nproc-per-node 2 -m torchgpu.parallel.stages_demo --configs gpipe:4,1f1b:4 \\
        --batches 10,12,8 --accumulate 2 --out DIR

writes ``DIR/<schedule>_<chunks>[_<spr>]_rank<r>.pt`` per config and rank.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def demo_model(width: int, layers: int, seed: int) -> nn.Sequential:
    """``layers`` x (Linear(width) + ReLU), seeded: the same weights on every rank."""
    torch.manual_seed(seed)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods)


def demo_batch(batch: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded regression batch ``(x, y)``."""
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen)


def run_demo(args: argparse.Namespace) -> None:
    """Train the demo model ``args.steps`` SGD steps for each ``schedule:chunks[:spr]``
    config (step ``i`` on a batch of ``batches[i % len(batches)]`` rows; the optimizer
    steps every ``args.accumulate`` batches) and save each rank's losses, weights, the
    last gradients before the final update and the forward output of the last batch to
    ``args.out``."""
    from torchgpu.parallel.stages import StagePipeline

    rank = dist.get_rank()
    device = (
        torch.device("cpu")
        if args.device == "cpu"
        else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    )
    sizes = [int(b) for b in str(args.batches or args.batch).split(",")]
    for config in args.configs.split(","):
        name, chunks, *rest = config.split(":")
        spr = int(rest[0]) if rest else 1
        pipe = StagePipeline(
            demo_model(args.width, args.layers, args.seed),
            device=device,
            loss_fn=nn.functional.mse_loss,
            schedule=name,
            chunks=int(chunks),
            stages_per_rank=spr,
        )
        opt = torch.optim.SGD(pipe.parameters(), lr=args.lr)
        losses, grads = [], {}
        for i in range(args.steps):
            x, y = demo_batch(sizes[i % len(sizes)], args.width, args.seed)
            loss = pipe.step(x, y)
            if loss is not None:
                losses.append(float(loss))
            if (i + 1) % args.accumulate == 0 or i + 1 == args.steps:
                grads = {
                    n: p.grad.detach().cpu().clone()
                    for m in pipe.modules
                    for n, p in m.named_parameters()
                    if p.grad is not None
                }
                opt.step()
                opt.zero_grad()
        pipe.train(False)
        output = pipe.forward(x)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "losses": losses,
                "params": {k: v.cpu() for k, v in pipe.state_dict().items()},
                "grads": grads,
                "output": None if output is None else output.cpu(),
                "balance": list(pipe.balance),
            },
            out / f"{config.replace(':', '_')}_rank{rank}.pt",
        )
        dist.barrier()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m torchgpu.parallel.stages_demo ...`` under torchrun."""
    parser = argparse.ArgumentParser(prog="python -m torchgpu.parallel.stages_demo")
    parser.add_argument("--demo", action="store_true", help="accepted for compatibility")
    parser.add_argument(
        "--configs", default="gpipe:4", help="schedule:chunks[:stages_per_rank],..."
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--batches", default=None, help="rows per step, cycled: 12,8")
    parser.add_argument("--accumulate", type=int, default=1, help="batches per update")
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("gloo" if args.device == "cpu" else "nccl")
    try:
        run_demo(args)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
