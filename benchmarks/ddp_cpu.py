"""DDP on 2 CPU processes (gloo, 1 thread each): weak scaling, and torchgpu's loop vs a
hand-written DDP loop, all in one torchrun job.

Every process trains an MLP (13 -> H -> H -> 1) on its own batches of B samples
(weak scaling: the per-process work is fixed). Variants, interleaved round by round
(same seeded order on both ranks), each sample = S steps timed between barriers:

- single:        rank 0 alone, plain model, hand-written loop (rank 1 waits)
- raw_ddp:       both ranks, DistributedDataParallel, hand-written loop
- torchgpu_ddp:  both ranks, the same DDP model through torchgpu.train.loop.epoch.run_epoch,
                 set up as `torchgpu train` sets it up: OOM back-off armed, the
                 finite-gradient guard before every optimizer step, a stop flag, the
                 loss read every step and the periodic stop/loss agreement (one small
                 all-reduce about every 0.5 s and at the end of each sample's epoch)
- raw_ddp_logged (--logged): the hand-written loop that also reads ``loss.item()``
                 every step, as any loop that logs its loss does

Reported: weak-scaling efficiency = t(single) / t(ddp) per round (1.0 = perfect), and
torchgpu/raw speed ratio per round (medians).

    python benchmarks/ddp_cpu.py            # full size
    python benchmarks/ddp_cpu.py --quick    # tiny, checks it runs
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from torchgpu.accumulate import GradAccumulator
    from torchgpu.bench.timer import measure_interleaved
    from torchgpu.launch.stop_record import StopFlag
    from torchgpu.precision import Precision
    from torchgpu.train.guards.agreement import RankAgreement
    from torchgpu.train.loop.backoff import LoopBackoff
    from torchgpu.train.loop.epoch import run_epoch
    from torchgpu.train.loop.parts import LoopParts
    from torchgpu.train.state import TrainState

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(args.batch, 13, generator=g), torch.randn(args.batch, 1, generator=g))
               for _ in range(args.steps)]

    def mlp() -> nn.Module:
        torch.manual_seed(0)
        h = args.hidden
        return nn.Sequential(nn.Linear(13, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(),
                             nn.Linear(h, 1))

    def hand_loop(model: nn.Module, logged: bool = False) -> Callable[[], None]:
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        loss_fn = nn.MSELoss()

        def run() -> None:
            for x, y in batches:
                opt.zero_grad(set_to_none=True)
                loss_fn(model(x), y).backward()
                opt.step()

        def run_logged() -> None:
            losses = []
            for x, y in batches:
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(model(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.item())

        return run_logged if logged else run

    def timed(fn: Callable[[], None], ranks: tuple[int, ...]) -> Callable[[], float]:
        def sample() -> float:
            dist.barrier()
            start = time.perf_counter()
            if rank in ranks:
                fn()
            dist.barrier()
            return time.perf_counter() - start

        return sample

    single = hand_loop(mlp())
    raw = hand_loop(DDP(mlp()))
    model = DDP(mlp())
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    prec = Precision("fp32", "cpu")
    acc = GradAccumulator(model, opt, 1, precision=prec)
    backoff = LoopBackoff(model, acc, nn.MSELoss(), batch_size=args.batch, distributed=True)
    parts = LoopParts(model=model, loss_fn=nn.MSELoss(), accumulator=acc,
                      precision=prec, device=torch.device("cpu"), rank=rank, agree=True,
                      backoff=backoff, agreement=RankAgreement(dist.get_world_size()))
    stop = StopFlag()

    def ours() -> None:
        run_epoch(parts, batches, TrainState(), batches_per_epoch=len(batches), stop=stop)

    variants = {"single": timed(single, (0,)), "raw_ddp": timed(raw, (0, 1)),
                "torchgpu_ddp": timed(ours, (0, 1))}
    if args.logged:
        variants["raw_ddp_logged"] = timed(hand_loop(DDP(mlp()), logged=True), (0, 1))
    results = measure_interleaved(variants, rounds=args.rounds, warmup=1, seed=1)
    if rank == 0:
        s, r, t = (results[k].samples for k in ("single", "raw_ddp", "torchgpu_ddp"))
        report = {
            "hidden": args.hidden, "batch_per_process": args.batch, "steps": args.steps,
            "rounds": args.rounds, "processes": dist.get_world_size(), "threads": 1,
            "steps_per_s": {k: args.steps / m.median for k, m in results.items()},
            "weak_scaling_efficiency": {
                "raw_ddp": statistics.median(a / b for a, b in zip(s, r, strict=True)),
                "torchgpu_ddp": statistics.median(a / b for a, b in zip(s, t, strict=True)),
            },
            "torchgpu_vs_raw_ddp": statistics.median(a / b for a, b in zip(r, t, strict=True)),
        }
        if args.logged:
            g = results["raw_ddp_logged"].samples
            report["torchgpu_vs_raw_ddp_logged"] = statistics.median(
                a / b for a, b in zip(g, t, strict=True))
        print(json.dumps(report, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=256, help="per process")
    parser.add_argument("--steps", type=int, default=100, help="steps per sample")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--logged", action="store_true",
                        help="add a hand-written DDP loop that reads loss.item() every step")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds = 10, 3
    if args.worker:
        import torch.distributed as dist

        worker(args)
        # Free the DDP models (reference cycles) before the group goes: destroying the
        # group under live DDP reducers aborts the process at exit now and then (gloo).
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    forwarded = [a for a in sys.argv[1:] if a != "--quick"]
    forwarded += ["--steps", str(args.steps), "--rounds", str(args.rounds)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--nnodes=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--local-addr=127.0.0.1",
           __file__, "--worker", *forwarded]
    sys.exit(subprocess.run(cmd, env=env, check=False).returncode)


if __name__ == "__main__":
    main()
