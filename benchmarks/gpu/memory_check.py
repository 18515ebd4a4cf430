"""``estimate_memory`` against ``torch.cuda.max_memory_allocated``, model by model.

For each case (ResNet-50, the MLPs, LeNet-5 and a small transformer written here, in fp32
and, for the big ones, bf16 autocast) the estimate is made on meta tensors, then the model
trains for real on the GPU: two Adam steps to create the optimizer state, then the peak
of a third step is read, counted from the allocated bytes before the model was moved
(so weights, gradients, optimizer state, input and activations are all in it, as in the
estimate). error = (estimated - measured) / measured; the goal is within 15%.

    PYTHONPATH=src python3 benchmarks/gpu/memory_check.py --device cuda:0 --json OUT.json
    PYTHONPATH=src python3 benchmarks/gpu/memory_check.py --device cpu --models housing

On a CPU only the estimates are printed (``measured_bytes`` null): nothing to compare.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent / "src"))

GOAL = 0.15


class TinyGPT(nn.Module):
    """A transformer-style language model: token and position embeddings, pre-norm
    encoder layers with a causal mask, a final norm and a vocabulary head."""

    def __init__(self, vocab: int = 8000, width: int = 512, layers: int = 6, heads: int = 8,
                 context: int = 256) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: Tensor) -> Tensor:
        steps = ids.shape[1]
        where = torch.arange(steps, device=ids.device)
        mask = nn.Transformer.generate_square_subsequent_mask(steps, device=ids.device)
        x = self.tokens(ids) + self.positions(where)
        return self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))


def _mlp(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


@dataclass(frozen=True)
class Case:
    """A model, its input's shape and dtype, and the precision it trains in."""

    model: str
    build: Callable[[], nn.Module]
    shape: tuple[int, ...]
    precision: str = "fp32"
    integer_input: int = 0  # > 0: token ids below this value

    @property
    def label(self) -> str:
        return f"{self.model} {self.precision} {'x'.join(map(str, self.shape))}"

    def inputs(self, device: str | torch.device) -> Tensor:
        if self.integer_input:
            if str(device) == "meta":
                return torch.empty(*self.shape, dtype=torch.long, device="meta")
            return torch.randint(0, self.integer_input, self.shape, device=device)
        if str(device) == "meta":
            return torch.empty(*self.shape, device="meta")
        return torch.randn(*self.shape, device=device)


def _resnet50() -> nn.Module:
    from torchgpu.models import resnet50

    return resnet50()


def _housing() -> nn.Module:
    from torchgpu.models import HousingNet

    return HousingNet()


def _lenet() -> nn.Module:
    from torchgpu.models.lenet import LeNet5

    return LeNet5()


CASES = (
    Case("resnet50", _resnet50, (64, 3, 128, 128)),
    Case("resnet50", _resnet50, (64, 3, 128, 128), "bf16"),
    Case("housing", _housing, (4096, 13)),
    Case("mlp-4x512", lambda: _mlp(512, 4), (4096, 512)),
    Case("lenet", _lenet, (512, 1, 28, 28)),
    Case("transformer", TinyGPT, (16, 256), integer_input=8000),
    Case("transformer", TinyGPT, (16, 256), "bf16", integer_input=8000),
)


def autocast(case: Case, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if case.precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def measured_peak(case: Case, model: nn.Module, device: torch.device) -> int:
    """Peak bytes allocated by the model, its optimizer and one steady-state Adam step."""
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    model.to(device).train()
    x = case.inputs(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step() -> None:
        with autocast(case, device):
            out = model(x)
        out.float().sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):  # the first step creates the optimizer state
        step()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - start)


def check(case: Case, device: torch.device) -> dict[str, Any]:
    """One row: estimated and (on CUDA) measured peak bytes, and the error."""
    from torchgpu.memory.estimate import estimate_memory

    torch.manual_seed(0)
    model = case.build()
    estimate = estimate_memory(model, case.inputs("meta"), optimizer="adam",
                               precision=case.precision)
    row: dict[str, Any] = {"model": case.model, "precision": case.precision,
                           "input": list(case.shape), "estimated_bytes": estimate.peak_bytes,
                           "measured_bytes": None, "error": None, "within_goal": None}
    if device.type == "cuda":
        measured = measured_peak(case, model, device)
        error = (estimate.peak_bytes - measured) / measured if measured else math.inf
        row.update(measured_bytes=measured, error=error, within_goal=abs(error) <= GOAL)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def render(rows: Sequence[dict[str, Any]]) -> str:
    lines = [f"{'case':<40} {'estimated':>12} {'measured':>12} {'error':>8}"]
    for r in rows:
        measured = f"{r['measured_bytes'] / 2**20:,.0f} MiB" if r["measured_bytes"] else "-"
        error = f"{r['error']:+.1%}" if r["error"] is not None else "-"
        label = f"{r['model']} {r['precision']} {'x'.join(map(str, r['input']))}"
        lines.append(f"{label:<40} {r['estimated_bytes'] / 2**20:>8,.0f} MiB {measured:>12} "
                     f"{error:>8}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    names = sorted({c.model for c in CASES})
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0", help="cuda:N measures; cpu estimates only")
    p.add_argument("--models", default="", metavar="NAME,...",
                   help=f"only these models ({', '.join(names)}; default all)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write rows here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA GPU is visible; --device cpu gives the "
                "estimates alone")
    wanted = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        p.error(f"--models {','.join(unknown)}: unknown; choose from {', '.join(names)}")
    cases = [c for c in CASES if not wanted or c.model in wanted]
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = False  # autotuning workspaces would move the peak
    rows = [check(case, device) for case in cases]
    print(render(rows))
    bad = [r for r in rows if r["within_goal"] is False]
    doc = {"device": str(device), "device_name": torch.cuda.get_device_name(device)
           if device.type == "cuda" else None, "torch": torch.__version__, "goal": GOAL,
           "rows": rows, "outside_goal": len(bad)}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
