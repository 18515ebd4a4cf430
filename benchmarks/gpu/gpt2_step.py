"""GPT-2 small training steps on one device: torchgpu's loop vs a hand-written loop, eager
and compiled, with the host syncs each optimizer step costs.

The model is transformers' ``GPT2LMHeadModel`` from a ``GPT2Config`` (12 layers, 768 wide,
12 heads, vocabulary 50257: GPT-2 small, 124M parameters, random weights, nothing
downloaded), behind a wrapper that returns the logits; the loss is next-token
cross-entropy. bf16 autocast, Adam with the kernels ``torchgpu train`` picks (fused on
CUDA) on both sides, so the loops are all that differ. Per mode (eager, then compiled
with ``torch.compile``):

- ``raw loop``: the hand-written loop (copy, zero_grad, forward under autocast, loss,
  backward, step) that reads the loss only every ``--log-every`` steps, as a tuned loop
  logs it;
- ``raw loop, second copy``: the same on a second model: its ratio to ``raw loop`` is the
  comparison's noise floor;
- ``torchgpu loop``: what ``torchgpu train``/``torchgpu.fit`` run per step, built as the
  runner builds it (:class:`torchgpu.bench.suites.train_step.TrainEpoch` with
  :func:`~torchgpu.bench.suites.train_step.loop_parts`: ``run_epoch``, GradAccumulator,
  Precision, OOM back-off armed, step records, the Prefetcher on CUDA); compiled with
  the runner's own :func:`torchgpu.train.recipe.compiling.compile_for_run`.

Each variant's first call (the compile, cuDNN/cuBLAS warm-up) is timed apart; then
interleaved rounds (a seeded shuffle per round, synchronize-bracketed, median) of
``--steps`` optimizer steps each. Ratios per round: ``torchgpu loop / raw loop`` and the
noise row. Host syncs: on CUDA one more call per variant under
``torch.cuda.set_sync_debug_mode("warn")``, counting the warnings (set back to 0 after);
``syncs_per_step`` counts those between the first and the last step's end (steady
state), ``syncs_per_call`` the whole call, with the source lines that synced. A
measurement, not a check: the script succeeds whatever the count.

Written like a bench suite (results.json, report.md) into ``--out``, rewritten after each
mode, so a run stopped during the compile keeps the eager figures.

    PYTHONPATH=src python3 benchmarks/gpu/gpt2_step.py --device cuda:0 --out DIR
    PYTHONPATH=src python3 benchmarks/gpu/gpt2_step.py --device cpu --tiny --out DIR
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent / "src"))

from torchgpu.bench.pressure import PressureMonitor
from torchgpu.bench.report import write_report
from torchgpu.bench.result import SuiteResult
from torchgpu.bench.suites.common import sync_for
from torchgpu.bench.timer import Measurement, Ratio, measure_interleaved, pairwise_ratios

LR = 1e-4
RAW, RAW_COPY, OURS = "raw loop", "raw loop, second copy", "torchgpu loop"
MODES = ("eager", "compile")
SYNC_WARNING = "synchroniz"  # "called a synchronizing CUDA operation"
Batches = list[tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class Size:
    layers: int = 12
    width: int = 768
    heads: int = 12
    vocab: int = 50257
    seq: int = 1024
    batch: int = 16


# GPT-2 small at 16 x 1024 tokens: ~0.86 GFLOP a token fwd+bwd (6 x 124M + attention),
# ~14 TFLOP a step. Measured on an H200 (torch 2.11, transformers 5.17, sdpa attention):
# 103 ms a step eager, 50 ms compiled, 25 GB peak. There, eager, transformers' attention
# mask code (masking_utils) synced once a step in every loop: the raw loop's count is the
# model's own, the difference to it the loop's.
FULL = Size()
TINY = Size(layers=2, width=64, heads=2, vocab=512, seq=64, batch=2)


class LogitsOnly(nn.Module):
    """The language model as a plain ``inputs -> logits`` module."""

    attention = "?"  # the attention implementation transformers picked (sdpa, eager)

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: Tensor) -> Tensor:
        logits: Tensor = self.lm(input_ids=input_ids, use_cache=False).logits
        return logits


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Next-token cross-entropy (targets are the inputs shifted by one)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_model(size: Size, device: torch.device) -> nn.Module:
    """GPT-2 (``size``), seeded: every variant starts from the same weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=size.vocab, n_positions=size.seq, n_embd=size.width,
                        n_layer=size.layers, n_head=size.heads,
                        bos_token_id=size.vocab - 1, eos_token_id=size.vocab - 1)
    torch.manual_seed(0)
    lm = GPT2LMHeadModel(config)
    LogitsOnly.attention = str(getattr(lm.config, "_attn_implementation", None))
    return LogitsOnly(lm).to(device)


def make_batches(size: Size, count: int, device: torch.device) -> Batches:
    """``count`` (tokens, next tokens) batches on the host, pinned for CUDA."""
    gen = torch.Generator().manual_seed(1)
    made = []
    for _ in range(count):
        tokens = torch.randint(0, size.vocab, (size.batch, size.seq + 1), generator=gen)
        made.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    if device.type == "cuda":
        made = [(x.pin_memory(), y.pin_memory()) for x, y in made]
    return made


def adam(model: nn.Module) -> torch.optim.Optimizer:
    """The engine's Adam (its kernel options: fused on one CUDA device), for the raw loop."""
    from torchgpu.train.recipe.optimizers import kernel_options

    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.Adam(params, lr=LR, fused=kernel_options(params).get("fused"))


@dataclass
class RawLoop:
    """One call = ``len(batches)`` steps of the hand-written loop; the loss is read (a
    host sync) every ``log_every`` steps, counted over calls."""

    model: nn.Module
    batches: Batches
    device: torch.device
    dtype: torch.dtype | None
    log_every: int
    optimizer: torch.optim.Optimizer = field(init=False)
    step: int = 0
    last_loss: float | None = None
    on_step: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        self.optimizer = adam(self.model)

    def __call__(self) -> None:
        model, optimizer, device = self.model, self.optimizer, self.device
        model.train()
        for xb, yb in self.batches:
            x = xb.to(device, non_blocking=True)
            y = yb.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=self.dtype or torch.float32,
                                enabled=self.dtype is not None):
                loss = lm_loss(model(x), y)
            loss.backward()
            optimizer.step()
            self.step += 1
            if self.step % self.log_every == 0:
                self.last_loss = loss.item()
            if self.on_step is not None:
                self.on_step()


def engine_loop(model: nn.Module, batches: Batches, device: torch.device, precision: str
                ) -> Any:
    """One call = one epoch over ``batches`` through torchgpu's ``run_epoch``, its parts
    built as ``torchgpu train`` builds them (as benchmarks/gpu/resnet_step.py does)."""
    from torchgpu.bench.suites.train_step import TrainEpoch, loop_parts

    batch = int(batches[0][0].shape[0])
    epoch = TrainEpoch(model, device, batches, batch_size=batch, lr=LR)
    epoch.parts = loop_parts(model, device, batch_size=batch, lr=LR, loss_fn=lm_loss,
                             precision=precision, state=epoch.state,
                             samples=batch * len(batches))
    return epoch


def set_step_marker(variant: Any, marker: Callable[[], None] | None) -> None:
    """Call ``marker`` at every optimizer step's end of ``variant`` (None: stop)."""
    if isinstance(variant, RawLoop):
        variant.on_step = marker
        return
    original = getattr(variant, "_unmarked_on_step", None) or variant.on_step
    variant._unmarked_on_step = original
    if marker is None:
        variant.on_step = original
        return

    def on_step(state: Any) -> None:
        original(state)
        marker()

    variant.on_step = on_step


def count_syncs(variant: Any, device: torch.device, steps: int) -> dict[str, Any]:
    """One call of ``variant`` under ``set_sync_debug_mode("warn")``: the synchronizing
    operations it ran (warnings), in all and between its first and last step's end."""
    torch.cuda.synchronize(device)
    marks: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        set_step_marker(variant, lambda: marks.append(len(caught)))
        torch.cuda.set_sync_debug_mode("warn")
        try:
            variant()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            set_step_marker(variant, None)
    torch.cuda.synchronize(device)
    hits = [i for i, w in enumerate(caught) if SYNC_WARNING in str(w.message)]
    where = Counter(f"{Path(caught[i].filename).name}:{caught[i].lineno}" for i in hits)
    steady = (sum(1 for i in hits if marks[0] <= i < marks[-1]) / (len(marks) - 1)
              if len(marks) >= 2 else None)
    return {"syncs_per_call": len(hits), "steps_per_call": steps, "step_marks": len(marks),
            "syncs_per_step": steady, "where": dict(where.most_common(8))}


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass
class Args:
    device: torch.device
    size: Size
    steps: int
    rounds: int
    warmup: int
    log_every: int
    precision: str


def run_mode(mode: str, args: Args, batches: Batches) -> tuple[list[Measurement],
                                                               list[Ratio], dict[str, Any]]:
    """One mode's variants: first calls, interleaved rounds, ratios, sync counts."""
    device = args.device
    dtype = torch.bfloat16 if args.precision == "bf16" else None
    variants: dict[str, Any] = {}
    info: dict[str, Any] = {"first_call_s": {}, "syncs": {}}
    for name in (RAW, RAW_COPY, OURS):
        model = make_model(args.size, device)
        key = f"{name} ({mode})"
        if name == OURS:
            if mode == "compile":
                from torchgpu.train.recipe.compiling import compile_for_run

                model, _ = compile_for_run(model, None)
            variants[key] = engine_loop(model, batches, device, args.precision)
        else:
            if mode == "compile":
                model.compile()
            variants[key] = RawLoop(model, batches, device, dtype, args.log_every)
    sync = sync_for([device])
    for key, variant in variants.items():  # the compile, cuDNN/cuBLAS's first calls
        if sync is not None:
            sync()
        started = time.perf_counter()
        variant()
        if sync is not None:
            sync()
        info["first_call_s"][key] = round(time.perf_counter() - started, 2)
        print(f"{key}: first call {info['first_call_s'][key]} s", flush=True)
    if mode == "compile":
        state = getattr(variants[f"{OURS} ({mode})"].parts.model, "_torchgpu_compile", None)
        info["engine_compile"] = state.as_dict() if state is not None else None
    timed = measure_interleaved(variants, args.rounds, args.warmup, sync)
    if device.type == "cuda":
        for key, variant in variants.items():
            info["syncs"][key] = count_syncs(variant, device, args.steps)
            print(f"{key}: host syncs {info['syncs'][key]}", flush=True)
        info["max_memory_allocated_gib"] = round(
            torch.cuda.max_memory_allocated(device) / 2**30, 2)
    tokens = args.size.batch * args.size.seq * args.steps
    measurements = []
    for key, m in timed.items():
        syncs = info["syncs"].get(key, {})
        measurements.append(m.with_extra(
            mode=mode, step_ms=m.median / args.steps * 1e3,
            tokens_per_s=tokens / m.median if m.median > 0 else None,
            syncs_per_step=syncs.get("syncs_per_step"),
            syncs_per_call=syncs.get("syncs_per_call")))
    ratios = pairwise_ratios(timed, [(f"{OURS} ({mode})", f"{RAW} ({mode})"),
                                     (f"{RAW_COPY} ({mode})", f"{RAW} ({mode})")])
    return measurements, ratios, info


def result(args: Args, measurements: Sequence[Measurement], ratios: Sequence[Ratio],
           infos: dict[str, Any], skipped: dict[str, str], tiny: bool) -> SuiteResult:
    size = args.size
    verdicts = []
    for r in ratios:
        what = ("noise floor (raw vs raw)" if RAW_COPY in r.numerator
                else "torchgpu loop / raw loop")
        verdicts.append(f"{r.numerator} / {r.denominator}: {r.median:.3f}x "
                        f"[{r.min:.3f}x .. {r.max:.3f}x] ({what})")
    for info in infos.values():
        for key, s in info.get("syncs", {}).items():
            per = s["syncs_per_step"]
            verdicts.append(f"{key}: " + (f"{per:.2f} host syncs per optimizer step"
                                          if per is not None else "syncs not counted")
                            + f" ({s['syncs_per_call']} in a call of {s['steps_per_call']}"
                            " steps)")
    notes = [f"GPT-2 ({size.layers} layers, {size.width} wide, {size.heads} heads, "
             f"vocabulary {size.vocab}), batch {size.batch} x {size.seq} tokens, "
             f"{args.precision} autocast, Adam lr {LR}; one sample = {args.steps} optimizer "
             f"steps; {args.rounds} rounds after {args.warmup} warm-up call(s), interleaved "
             "(seeded shuffle per round), synchronize-bracketed.",
             f"'{RAW}' reads the loss every {args.log_every} steps; '{RAW_COPY}' is the same "
             "loop on a second model (the noise floor).",
             "syncs_per_step: set_sync_debug_mode('warn') warnings between the first and "
             "the last step's end of one call, per step (a measurement, not a check); "
             "'where' in config.modes names the lines that synced.",
             *(f"mode {m} skipped: {why}" for m, why in skipped.items())]
    return SuiteResult(
        suite="gpt2-step", quick=tiny, devices=(str(args.device),),
        measurements=tuple(measurements), ratios=tuple(ratios), notes=tuple(notes),
        config={"model": "transformers GPT2LMHeadModel",
                "transformers": _version("transformers"), "attention": LogitsOnly.attention,
                "layers": size.layers,
                "width": size.width, "heads": size.heads, "vocab": size.vocab,
                "seq": size.seq, "batch_size": size.batch, "steps_per_sample": args.steps,
                "rounds": args.rounds, "warmup": args.warmup, "log_every": args.log_every,
                "precision": args.precision, "optimizer": "Adam (engine kernel options)",
                "modes": infos, "skipped": skipped},
        verdicts=tuple(verdicts))


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0", help="cuda:N or cpu (default cuda:0)")
    p.add_argument("--out", type=Path, required=True, help="directory for results.json")
    p.add_argument("--tiny", action="store_true",
                   help="2 layers, 64 wide, 64 tokens, batch 2, 2 rounds: checks that it runs")
    p.add_argument("--modes", default="eager,compile",
                   help="comma-separated, of eager,compile (default both, in that order)")
    p.add_argument("--batch-size", type=int, default=None, help="default 16 (tiny 2)")
    p.add_argument("--seq", type=int, default=None, help="tokens a sample (default 1024)")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps a timed call (default 10, tiny 4)")
    p.add_argument("--rounds", type=int, default=None, help="default 5 (tiny 2)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed calls before the rounds (after each variant's first call)")
    p.add_argument("--log-every", type=int, default=None,
                   help="the raw loop reads its loss every N steps (default: --steps)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="skip the compiled mode when less than --compile-needs seconds of "
                        "this limit are left after the eager one (default: no limit)")
    p.add_argument("--compile-needs", type=float, default=100.0, metavar="S",
                   help="what the compiled mode needs (default 100 s: GPT-2 small compiles "
                        "in ~40-90 s)")
    a = p.parse_args(argv)
    started = time.perf_counter()
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {a.device}: no CUDA GPU is visible; use --device cpu --tiny")
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        p.error(f"--modes {a.modes}: use eager, compile or both (eager,compile)")
    base = TINY if a.tiny else FULL
    size = Size(base.layers, base.width, base.heads, base.vocab, a.seq or base.seq,
                a.batch_size or base.batch)
    steps = a.steps or (4 if a.tiny else 10)
    args = Args(device, size, steps, a.rounds or (2 if a.tiny else 5), a.warmup,
                a.log_every or steps, a.precision)
    batches = make_batches(size, steps, device)
    monitor = PressureMonitor()
    monitor.start()
    measurements: list[Measurement] = []
    ratios: list[Ratio] = []
    infos: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    failed: dict[str, str] = {}
    argv_seen = ["benchmarks/gpu/gpt2_step.py", *(argv if argv is not None else sys.argv[1:])]
    for mode in modes:
        elapsed = time.perf_counter() - started
        if (mode == "compile" and a.time_limit is not None
                and a.time_limit - elapsed < a.compile_needs):
            skipped[mode] = (f"{a.time_limit - elapsed:.0f} s of --time-limit {a.time_limit:g} "
                             f"left, it needs ~{a.compile_needs:g} s")
            print(f"skipping {mode}: {skipped[mode]}", flush=True)
            continue
        print(f"== {mode}", flush=True)
        try:
            found, rows, info = run_mode(mode, args, batches)
        except Exception as error:  # e.g. the raw loop's compile: keep the other mode's rows
            traceback.print_exc()
            failed[mode] = f"{type(error).__name__}: {str(error).strip()[:300]}"
            skipped[mode] = f"failed: {failed[mode]}"
            free(device)
            continue
        free(device)  # this mode's models and optimizers, before the next mode's
        measurements += found
        ratios += rows
        infos[mode] = info
        # written after every mode: a run stopped in the compile keeps the eager figures
        doc = write_report(result(args, measurements, ratios, infos, skipped, a.tiny), a.out,
                           None, time.perf_counter() - started, argv=argv_seen)
    pressure = monitor.stop()
    doc = write_report(result(args, measurements, ratios, infos, skipped, a.tiny), a.out,
                       pressure, time.perf_counter() - started, argv=argv_seen)
    for verdict in doc["verdicts"]:
        print(verdict)
    print(f"results: {a.out / 'results.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
