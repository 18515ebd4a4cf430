"""The whole `make demo` process against a plain PyTorch script doing the same training.

`torchgpu train --example housing --epochs E` (start-up, data, model, the loop, evaluation
each epoch, metrics, plot, summary and model files) is timed as a process, beside a
hand-written script that trains the same network on the same data the same way (Adam at
0.01, batch 16, MSE, shuffled each epoch, test loss each epoch, the weights saved at the
end). Rounds are interleaved, and a second copy of the plain script gives the noise row.

Both sides import torchgpu (the plain script for the same data), so its sources are
byte-compiled first, as in any installed or once-run package: where
PYTHONDONTWRITEBYTECODE is set, every run would otherwise compile the ~90 modules that
``torchgpu train`` imports (~60 ms) but the plain script not (``--no-compile`` keeps that).

usage: python benchmarks/demo_vs_script.py [--epochs 200] [--rounds 5] [--json FILE.json]
       [--quick] [--no-compile]

With ``--json`` (alias ``--out``) it runs through ``python -m torchgpu.bench.extra`` into
benchmarks/results/<machine>/extra/demo_vs_script.json (``EXTRAS=demo_vs_script
benchmarks/run.sh``), rendered by benchmarks/summarize.py.
"""

from __future__ import annotations

import argparse
import compileall
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PLAIN = """
import sys, torch
from torch import nn
from torch.utils.data import DataLoader
from torchgpu.data import example_data   # the same table and split (data prep is not timed apart)
epochs, out = int(sys.argv[1]), sys.argv[2]
data = example_data("housing", seed=0)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(13, 16), nn.ReLU(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
loss_fn = nn.MSELoss()
g = torch.Generator().manual_seed(0)
train = DataLoader(data.train, batch_size=16, shuffle=True, generator=g)
test = DataLoader(data.test, batch_size=256)
for epoch in range(epochs):
    model.train()
    for x, y in train:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.item()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        test_loss = sum(float(loss_fn(model(x), y)) * len(x) for x, y in test) / len(data.test)
    print(f"epoch {epoch + 1} test {test_loss:.4f}")
torch.save(model.state_dict(), out)
"""


def _time(cmd: list[str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", "--out", dest="out", type=Path)
    parser.add_argument("--quick", action="store_true", help="20 epochs, 2 rounds")
    parser.add_argument("--no-compile", action="store_true",
                        help="do not byte-compile torchgpu's sources first")
    args = parser.parse_args()
    if args.quick:
        args.epochs, args.rounds = 20, 2
    compiled = False
    if not args.no_compile:
        import torchgpu  # the package the timed processes import (same sys.path)

        compiled = bool(compileall.compile_dir(Path(torchgpu.__file__).parent, quiet=2))
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "plain.py"
        script.write_text(PLAIN)
        times: dict[str, list[float]] = {"plain script": [], "plain script, second copy": [],
                                         "torchgpu train (make demo)": []}
        for r in range(args.rounds):
            times["plain script"].append(
                _time([sys.executable, str(script), str(args.epochs), f"{tmp}/a{r}.pt"]))
            times["torchgpu train (make demo)"].append(_time(
                [sys.executable, "-m", "torchgpu", "train", "--example", "housing", "--epochs",
                 str(args.epochs), "--out", f"{tmp}/run{r}", "--progress", "plain"]))
            times["plain script, second copy"].append(
                _time([sys.executable, str(script), str(args.epochs), f"{tmp}/b{r}.pt"]))
    base = times["plain script"]
    rows = []
    for name, values in times.items():
        ratios = [v / b for v, b in zip(values, base, strict=True)]
        rows.append({"name": name, "median_s": statistics.median(values),
                     "min_s": min(values), "max_s": max(values),
                     "ratio_to_plain": statistics.median(ratios),
                     "ratio_min": min(ratios), "ratio_max": max(ratios), "samples": values})
    print(f"whole process, housing, {args.epochs} epochs, {args.rounds} interleaved rounds "
          "(ratio: median of per-round ratios to the plain script; torchgpu "
          f"{'byte-compiled first' if compiled else 'not byte-compiled first'})")
    for row in rows:
        print(f"  {row['name']:28s} {row['median_s']:7.2f} s  x{row['ratio_to_plain']:.3f} "
              f"[{row['ratio_min']:.3f} .. {row['ratio_max']:.3f}]")
    if args.out:
        args.out.write_text(json.dumps({"epochs": args.epochs, "rounds": args.rounds,
                                        "compiled": compiled, "target_ratio": 1.05,
                                        "threads": "torch's default",
                                        "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
