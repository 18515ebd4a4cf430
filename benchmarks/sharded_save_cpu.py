"""Sharded vs gathered checkpoint of an FSDP2 model on 2 CPU processes (gloo): save time
and peak host memory (RSS), both measured in the same torchrun job.

The model is an MLP of ``--layers`` Linear(W, W) layers (``--width`` W; the default is
~200 MB of fp32 weights, ~600 MB with Adam's two moments), sharded with FSDP2 over 2
ranks, after one Adam step. Variants, interleaved round by round (``--rounds``):

- sharded:  :class:`torchgpu.checkpoint.sharded.ShardedSaver` (what ``torchgpu train
            --strategy fsdp`` writes): every rank writes its own shards of the model and
            optimizer, rank 0 publishes the directory with its manifest.
- gathered: the single-file way: the whole model and optimizer state gathered on rank 0
            (``get_state_dict(full_state_dict=True, cpu_offload=True)``), serialised in
            memory and written atomically by rank 0.

Per variant and rank: the median save time (barrier to barrier, so the slowest rank
counts) and the peak RSS during the save above the RSS before it (the kernel's
high-water mark, reset before each save through /proc/self/clear_refs). The ratios
(gathered / sharded) are of medians from the same job.

    python benchmarks/sharded_save_cpu.py --json           # full size, JSON on stdout
    python benchmarks/sharded_save_cpu.py --quick --json   # tiny, checks it runs
    python -m torchgpu.bench.extra benchmarks/sharded_save_cpu.py OUT.json  # with context
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as handle:  # resets VmHWM (Linux >= 4.0)
        handle.write("5")


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from torchgpu.checkpoint.atomic import write_file_atomic
    from torchgpu.checkpoint.layout import torch_bytes
    from torchgpu.checkpoint.sharded import ShardedSaver
    from torchgpu.parallel.data import wrap_data_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    model = wrap_data_parallel(nn.Sequential(*layers), "fsdp")
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, args.width)).sum().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    out = Path(args.dir)
    saver = ShardedSaver(rank=rank, world=world)

    def sharded(index: int) -> None:
        saver.save(out / "sharded" / f"step-{index:08d}", model=model, optimizer=optim,
                   step=index, epoch=0, keep_last=1)

    def gathered(index: int) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state, optim_state = get_state_dict(model, optim, options=options)
        if rank == 0:
            (out / "gathered").mkdir(parents=True, exist_ok=True)
            data = torch_bytes({"model": model_state, "optimizer": optim_state})
            write_file_atomic(out / "gathered" / "state.pt", data)
            del data
        del model_state, optim_state
        dist.barrier()

    variants = {"sharded": sharded, "gathered": gathered}
    results: dict[str, dict[str, list[float]]] = {
        name: {"seconds": [], "peak_rss_above_mib": []} for name in variants}
    index = 0
    for _ in range(args.rounds):
        for name, save in variants.items():
            index += 1
            dist.barrier()
            before = _rss_kib("VmRSS")
            _reset_peak()
            start = time.perf_counter()
            save(index)
            dist.barrier()
            seconds = time.perf_counter() - start
            results[name]["seconds"].append(seconds)
            results[name]["peak_rss_above_mib"].append((_rss_kib("VmHWM") - before) / 1024)
    gathered_all: list[object] = [None] * world
    dist.all_gather_object(gathered_all, results)
    if rank == 0:
        state_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        report = {"world_size": world, "model_fp32_mib": round(state_mib, 1),
                  "with_adam_mib": round(3 * state_mib, 1), "rounds": args.rounds,
                  "torch": torch.__version__, "by_rank": gathered_all}
        print("RESULT " + json.dumps(report), flush=True)
    saver.close()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a tiny model, one round")
    parser.add_argument("--json", nargs="?", const="-", metavar="FILE",
                        help="the result as JSON: to FILE, or to stdout without one")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.width, args.layers, args.rounds = 256, 2, 1
    work = Path(tempfile.mkdtemp(prefix="sharded-save-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(REPO / "src")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
           "--max-restarts=0", __file__, "--worker", "--dir", str(work),
           "--width", str(args.width), "--layers", str(args.layers),
           "--rounds", str(args.rounds)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800,
                              check=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if done.returncode != 0 or line is None:
        sys.exit(f"benchmark failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    report = json.loads(line[len("RESULT "):])
    summary: dict[str, object] = {}
    for name in ("sharded", "gathered"):
        per_rank = [r[name] for r in report["by_rank"]]
        summary[name] = {
            "seconds_median": round(statistics.median(per_rank[0]["seconds"]), 3),
            "peak_rss_above_mib_by_rank": [
                round(max(r["peak_rss_above_mib"]), 1) for r in per_rank]}
    sharded, gathered = summary["sharded"], summary["gathered"]
    assert isinstance(sharded, dict) and isinstance(gathered, dict)
    report["summary"] = summary
    report["ratio_gathered_over_sharded"] = {
        "seconds": round(gathered["seconds_median"] / max(sharded["seconds_median"], 1e-9), 2),
        "peak_rss_rank0": round(gathered["peak_rss_above_mib_by_rank"][0]
                                / max(sharded["peak_rss_above_mib_by_rank"][0], 1e-9), 2)}
    if args.json:
        text = json.dumps(report, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
        return
    print(f"model {report['model_fp32_mib']} MiB fp32 ({report['with_adam_mib']} MiB with "
          f"Adam), 2 gloo ranks, {report['rounds']} rounds")
    for name in ("sharded", "gathered"):
        row = summary[name]
        assert isinstance(row, dict)
        print(f"  {name:9s} {row['seconds_median']:7.3f} s   peak RSS above the start, by "
              f"rank: {row['peak_rss_above_mib_by_rank']} MiB")
    print(f"  gathered / sharded: {report['ratio_gathered_over_sharded']}")


if __name__ == "__main__":
    main()
