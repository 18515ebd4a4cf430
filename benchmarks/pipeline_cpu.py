"""Pipeline speed on two CPU processes (1 thread each): 8 x (Linear(1024) + ReLU),
global batch 512, one training step = forward + backward.

Variants, timed in interleaved rounds (every round runs each variant once, so drift in
machine load hits all alike), all in one torchrun job:

- single:     one process, one thread, the plain model (rank 1 idles at a barrier)
- naive:      2-stage model parallel, M=1 (torchgpu StagePipeline, GPipe, chunks=1)
- auto:       torchgpu StagePipeline (GPipe) with M chosen by the split-size sweep
- torch-*:    hand-written torch.distributed.pipelining configurations
              (PipelineStage + ScheduleGPipe / Schedule1F1B at several M); the best is reported

Memory per stage: parameter bytes, activation bytes saved for backward by one
micro-batch times the micro-batches in flight (GPipe: M, 1F1B: stages - rank), and peak
RSS of each process.

    python benchmarks/pipeline_cpu.py                      # full size (minutes)
    python benchmarks/pipeline_cpu.py --quick              # tiny, checks it runs
    python benchmarks/pipeline_cpu.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ----------------------------------------------------------------------------- worker
def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from torchgpu.parallel.balance import saved_bytes
    from torchgpu.parallel.stage_chunks import choose_stage_chunks
    from torchgpu.parallel.stages import StagePipeline, partition
    from torchgpu.parallel.stages_demo import demo_batch, demo_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = demo_batch(args.batch, args.width, 0)
    loss_fn = nn.functional.mse_loss
    cpu = torch.device("cpu")

    def clear(params: list[nn.Parameter]) -> None:
        for p in params:
            p.grad = None

    steps: dict[str, Callable[[], None]] = {}
    memory: dict[str, dict[str, Any]] = {}

    # single process, single thread: rank 0 alone
    single = demo_model(args.width, args.layers, 0)
    single_params = list(single.parameters())

    def single_step() -> None:
        if rank == 0:
            loss_fn(single(x), y).backward()
            clear(single_params)

    steps["single"] = single_step

    def stage_memory(mod: nn.Module, chunks: int, in_flight: int) -> dict[str, Any]:
        param_bytes = sum(p.numel() * p.element_size() for p in mod.parameters())
        rows = -(-args.batch // chunks)
        act, _ = saved_bytes(mod, torch.randn(rows, args.width, requires_grad=True))
        return {"param_bytes": param_bytes, "activation_bytes": act * in_flight}

    def ours(name: str, chunks: int | None) -> None:
        pipe = StagePipeline(
            demo_model(args.width, args.layers, 0),
            device=cpu,
            loss_fn=loss_fn,
            schedule="gpipe",
            chunks=chunks or 1,
        )
        params = list(pipe.parameters())
        if chunks is None:
            choice = choose_stage_chunks(pipe, x, y, args.candidates, steps=args.sweep_steps)
            pipe.chunks = choice.chunks
            if rank == 0:
                print("split-size sweep (rank 0):\n" + choice.format(), flush=True)
            memory[name + "_sweep"] = choice.to_dict()

        def step() -> None:
            pipe.step(x, y)
            clear(params)

        steps[name] = step
        memory[name] = {
            "chunks": pipe.chunks,
            **stage_memory(pipe.modules[0], pipe.chunks, pipe.chunks),
        }

    ours("naive", 1)
    ours("auto", None)

    # hand-written torch.distributed.pipelining configurations
    for sched_name, chunks in args.torch_configs:
        module = partition(demo_model(args.width, args.layers, 0), [args.layers] * 2)[rank]
        stage = PipelineStage(module, rank, world, cpu)
        cls = ScheduleGPipe if sched_name == "gpipe" else Schedule1F1B
        sched = cls(stage, n_microbatches=chunks, loss_fn=loss_fn)
        params = list(module.parameters())

        def tstep(sched: Any = sched, params: list[nn.Parameter] = params) -> None:
            if rank == 0:
                sched.step(x)
            else:
                sched.step(target=y, losses=[])
            clear(params)

        name = f"torch-{sched_name}-M{chunks}"
        steps[name] = tstep
        in_flight = chunks if sched_name == "gpipe" else min(chunks, world - rank)
        memory[name] = {"chunks": chunks, **stage_memory(module, chunks, in_flight)}

    # interleaved rounds; every step starts and ends at a barrier so ranks agree
    times: dict[str, list[float]] = {k: [] for k in steps}
    for r in range(args.warmup + args.rounds):
        for name, fn in steps.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            dist.barrier()
            if r >= args.warmup:
                times[name].append(time.perf_counter() - start)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # bytes (Linux: KiB)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "memory": memory, "peak_rss_bytes": peak_rss})
    if rank == 0:
        result = {
            "config": {k: v for k, v in vars(args).items() if k not in ("worker",)},
            "times": {
                k: {
                    "median_s": statistics.median(v),
                    "min_s": min(v),
                    "max_s": max(v),
                    "samples": v,
                }
                for k, v in times.items()
            },
            "ranks": gathered,
        }
        Path(args.result).write_text(json.dumps(result, indent=2))
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- parent
def report(result: dict[str, Any]) -> str:
    t = {k: v["median_s"] for k, v in result["times"].items()}
    torch_names = [k for k in t if k.startswith("torch-")]
    best_torch = min(torch_names, key=t.__getitem__) if torch_names else None
    lines = [f"{'variant':<22} {'median s':>9} {'min s':>8} {'max s':>8} {'vs naive':>9}"]
    for k, v in result["times"].items():
        lines.append(
            f"{k:<22} {v['median_s']:>9.4f} {v['min_s']:>8.4f} {v['max_s']:>8.4f} "
            f"{t['naive'] / v['median_s']:>8.2f}x"
        )
    auto_m = result["ranks"][0]["memory"]["auto"]["chunks"]
    lines.append("")
    lines.append(
        f"auto-chosen pipeline (M={auto_m}) vs naive model parallel: "
        f"{t['naive'] / t['auto']:.2f}x faster"
    )
    if best_torch:
        lines.append(
            f"best hand-picked torch.distributed.pipelining ({best_torch}) vs naive: "
            f"{t['naive'] / t[best_torch]:.2f}x faster"
        )
    lines.append(
        f"naive model parallel vs one process, one thread: "
        f"{(t['naive'] / t['single'] - 1) * 100:+.1f}% time"
    )
    lines.append("")
    lines.append("memory per stage (rank: parameters, activations in flight, peak RSS):")
    for r in result["ranks"]:
        parts = [
            f"{k} {m['param_bytes'] / 2**20:.1f}+{m['activation_bytes'] / 2**20:.1f} MiB"
            for k, m in r["memory"].items()
            if "param_bytes" in m
        ]
        lines.append(
            f"  rank {r['rank']}: peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB; "
            + "; ".join(parts)
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8, help="Linear+ReLU pairs")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--sweep-steps", type=int, default=3)
    p.add_argument("--candidates", default="1,2,4,8,16,32")
    p.add_argument("--torch-configs", default="gpipe:4,1f1b:4,gpipe:8,1f1b:8")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks that it runs")
    p.add_argument("--json", default="", help="also write the result JSON here")
    p.add_argument("--timeout", type=float, default=1800)
    args = p.parse_args()
    if args.quick:
        args.width, args.batch, args.rounds, args.warmup, args.sweep_steps = 64, 32, 2, 1, 1
        args.candidates, args.torch_configs = "1,2,4", "gpipe:4,1f1b:2"
    if args.worker:
        args.candidates = [int(c) for c in args.candidates.split(",")]
        args.torch_configs = [
            (s, int(m)) for s, m in (c.split(":") for c in args.torch_configs.split(","))
        ]
        worker(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "result.json"
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            MASTER_ADDR="127.0.0.1",
            GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
            PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
        )
        passthrough = [
            f"--{k.replace('_', '-')}={getattr(args, k)}"
            for k in (
                "width",
                "layers",
                "batch",
                "rounds",
                "warmup",
                "sweep_steps",
                "candidates",
                "torch_configs",
            )
        ]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            "--nnodes=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
            "--max-restarts=0",
            __file__,
            "--worker",
            f"--result={result_path}",
            *passthrough,
        ]
        proc = subprocess.run(cmd, env=env, timeout=args.timeout, check=False)
        if proc.returncode != 0 or not result_path.exists():
            print(f"benchmark workers failed (exit {proc.returncode})", file=sys.stderr)
            return 1
        result = json.loads(result_path.read_text())
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
