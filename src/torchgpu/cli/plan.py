"""``torchgpu plan``: memory per strategy on real or hypothetical devices, and the plan that fits.

    torchgpu plan [--example housing|lenet|resnet50
                   | --model SPEC (--input-shape 2,3,128,128[:DTYPE]
                                  | --data SPEC [--collate-fn SPEC])]
                  [--batch-size B]
                   [--devices auto|4x80GiB|2x24GiB,1x16GiB|cuda:0,cuda:1]
                  [--loss NAME|SPEC] [--optimizer adam] [--precision fp32] [--json]

Prints a table of every strategy (single, + accumulation, + activation checkpointing,
ddp, fsdp, model split, pipeline) with its memory on each device and whether it fits,
then the chosen plan, why, and the exact ``torchgpu train`` command that runs it as
printed: with ``--model --data`` it carries ``--loss`` (which data of ``(inputs,
target)`` pairs needs), ``--collate-fn`` when given and, when ``--optimizer`` was given,
that optimizer; where no command would run (``--model --input-shape``, which ``torchgpu
train`` cannot load; pairs without ``--loss``), the same settings as torchgpu Python
calls. The sample batch of ``--model`` comes from ``--input-shape`` (batch first; a
``:DTYPE`` suffix such as ``2,128:int64`` makes token ids) or from ``--data SPEC``
(``module.path:attr`` or ``path/to/file.py:attr`` naming a Dataset, a (train, eval) pair
or a function returning one: ``--batch-size`` items, default_collate-d or batched by
``--collate-fn SPEC`` as ``torchgpu train`` does; dict items are passed as
``model(**batch)``). A spec that does not resolve, a factory that fails, or a forward
that does not take the sample is a usage error (exit 2, one paragraph). ``--json``
prints the document of :mod:`torchgpu.planning.report` instead. Exit codes: 0 a plan was
found, 1 nothing fits (the table still prints, the numbers go to stderr), 2 bad flags.
"""

from __future__ import annotations

import json
import sys
import textwrap
from typing import TYPE_CHECKING, Any

from torchgpu.cli.common import ArgumentParser
from torchgpu.errors import PlanError, UsageError
from torchgpu.planning.targets import ACCEPTED, HEADROOM, parse_devices
from torchgpu.sizes import format_bytes

if TYPE_CHECKING:
    # torch, rich and the planner are imported once the flags parsed (in main, _render):
    # a mistyped flag or --help answers without importing torch.
    from torchgpu.planning.candidates import Candidate
    from torchgpu.planning.decide import Plan
    from torchgpu.planning.footprint import Footprint
    from torchgpu.planning.targets import DeviceTarget
    from torchgpu.planning.workload import Workload

EXAMPLES = ("housing", "lenet", "resnet50")
#: Input shape of one sample of each built-in example (torchgpu.data.example_data).
EXAMPLE_INPUT_SHAPES: dict[str, tuple[int, ...]] = {
    "housing": (13,),
    "lenet": (1, 28, 28),
    "resnet50": (3, 128, 128),
}
#: Default batch per optimizer step, as ``torchgpu train`` uses for each example.
EXAMPLE_BATCH_SIZES = {"housing": 16, "lenet": 64, "resnet50": 8}
#: Default batch for ``--model --data`` (``torchgpu train``'s default for a user model).
DATA_BATCH_SIZE = 16


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="torchgpu plan",
        description="Memory per strategy on real or hypothetical devices, and the plan that fits.",
    )
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--example", choices=EXAMPLES, help="built-in model (default housing)")
    what.add_argument("--model", metavar="MODULE:FACTORY", help="your model: module.path:factory")
    parser.add_argument(
        "--input-shape",
        metavar="N,C,H,W[:DTYPE]",
        help="with --model: the sample batch's shape, batch first; :int64 for token ids",
    )
    parser.add_argument(
        "--data",
        metavar="SPEC",
        help="with --model: take the sample batch from your dataset (module.path:attr)",
    )
    parser.add_argument(
        "--loss",
        metavar="NAME|SPEC",
        help="with --model --data: the loss the run: line passes to torchgpu train "
        "(mse|cross_entropy|module:function; data of (inputs, target) pairs needs one)",
    )
    parser.add_argument(
        "--collate-fn",
        metavar="SPEC",
        help="with --data: the function batching its items (e.g. padding token sequences)",
    )
    parser.add_argument("--batch-size", type=int, metavar="B", help="samples per optimizer step")
    parser.add_argument(
        "--devices", default="auto", metavar="SPEC", help=f"default auto; {ACCEPTED}"
    )
    parser.add_argument(
        "--optimizer", help="optimizer whose state to count (default adam); given, the run: "
        "line trains with it"
    )
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.model is None and (args.input_shape is not None or args.data is not None):
        flag = "--input-shape" if args.input_shape is not None else "--data"
        raise UsageError(f"{flag} goes with --model (built-in examples know their shape)")
    if args.loss is not None and args.data is None:
        raise UsageError(
            f"--loss {args.loss} goes with --model and --data: the loss is for the run: line's "
            "torchgpu train of your model on your data (built-in examples bring their own)"
        )
    if args.collate_fn is not None and args.data is None:
        raise UsageError(
            f"--collate-fn {args.collate_fn} goes with --model and --data SPEC: it batches "
            "the dataset's items"
        )
    optimizer = args.optimizer or "adam"
    if args.model is not None and args.input_shape is not None and args.data is not None:
        raise UsageError(
            "--input-shape and --data both describe the sample batch: give one of them"
        )
    if args.model is not None and args.input_shape is None and args.data is None:
        raise UsageError(
            f"--model {args.model} needs --input-shape, the shape of a sample batch, e.g. "
            "--input-shape 2,3,128,128 (or 2,128:int64 for token ids), or --data SPEC to "
            "take it from your dataset"
        )
    if args.batch_size is not None and args.batch_size < 1:
        raise UsageError(f"--batch-size {args.batch_size} must be at least 1, e.g. --batch-size 32")
    from torchgpu.train.config import MAX_COUNT

    if args.batch_size is not None and args.batch_size > MAX_COUNT:
        raise UsageError(
            f"--batch-size {args.batch_size} is out of range: it must be <= {MAX_COUNT} "
            "(samples per optimizer step). Pass a smaller value, e.g. --batch-size 32."
        )
    targets = parse_devices(args.devices)  # before the model: bad devices fail fast
    import torch

    from torchgpu.planning.candidates import all_candidates
    from torchgpu.planning.planner import plan_from_footprint
    from torchgpu.planning.report import document
    from torchgpu.planning.workload import Workload

    pairs = False
    example = args.example if args.model is None else None
    if example is None and args.model is None:
        example = "housing"
    if args.model is not None:
        from torchgpu.planning.custom import (
            build_custom_model,
            measure_custom_model,
            parse_input_shape,
            sample_from_data,
            shape_sample,
        )

        sample: Any
        if args.data is not None:
            batch = args.batch_size or DATA_BATCH_SIZE
            model = build_custom_model(args.model)  # UsageError (exit 2) if the factory fails
            sample, dicts = sample_from_data(args.data, batch, args.collate_fn)
            pairs = not dicts
            _check_loss(args.loss, args.data, dicts)
        else:
            shape, dtype = parse_input_shape(args.input_shape)
            model = build_custom_model(args.model)
            batch = args.batch_size or shape[0]
            sample = shape_sample(shape, dtype, batch)  # meta: nothing allocated
        footprint = measure_custom_model(
            model, args.model, sample, optimizer=optimizer, precision=args.precision,
            source="--input-shape" if args.data is None else "--data",
        )
    else:
        from torchgpu.models import build_model
        from torchgpu.planning.measure import measure_footprint

        assert example is not None
        model = build_model(example)
        batch = args.batch_size or EXAMPLE_BATCH_SIZES[example]
        sample = torch.empty(batch, *EXAMPLE_INPUT_SHAPES[example], device="meta")
        footprint = measure_footprint(
            model, sample, optimizer=optimizer, precision=args.precision
        )
    workload = Workload(
        batch, example=example, model=args.model, precision=args.precision,
        optimizer=optimizer, data=getattr(args, "data", None) if args.model else None,
        loss=args.loss, pairs=pairs, optimizer_given=args.optimizer is not None,
        collate_fn=args.collate_fn,
    )
    try:
        plan: Plan | None = plan_from_footprint(footprint, targets, workload)
        error = None
    except PlanError as failure:
        plan, error = None, str(failure)
    candidates = (
        list(plan.candidates) if plan is not None else all_candidates(footprint, targets, batch)
    )
    if args.json:
        print(json.dumps(document(workload, targets, footprint, candidates, plan, error), indent=2))
    else:
        _render(workload, targets, footprint, candidates, plan)
    if error is not None:
        print(f"torchgpu: {error}", file=sys.stderr)
        return PlanError.exit_code
    return 0


def _check_loss(loss: str | None, data: str, dicts: bool) -> None:
    """``--loss`` as ``torchgpu train`` takes it with ``--data`` (the run: line must run
    as printed): a built-in name or a spec that resolves to a callable; a built-in
    name is refused for dict batches, which have no separate target."""
    if loss is None:
        return
    from torchgpu.train.task import LOSS_NAMES, loss_by_name

    if ":" not in loss:
        loss_by_name(loss)  # UsageError naming the built-in losses
        if dicts:
            raise UsageError(
                f"--loss {loss} takes (output, target) but --data {data} yields dict batches, "
                "which have no separate target: drop --loss (the model's output.loss), or "
                "pass --loss module:function with a function loss(output, batch) -> Tensor"
            )
        assert loss in LOSS_NAMES
        return
    from torchgpu.factories import resolve_callable

    resolve_callable(loss, "loss")


def _per_device(values: tuple[int, ...]) -> str:
    """One figure when every device has the same, else each device's in order."""
    if len(set(values)) <= 1:
        return format_bytes(values[0]) if values else "-"
    return " / ".join(format_bytes(v) for v in values)


def _render(
    workload: Workload,
    targets: list[DeviceTarget],
    footprint: Footprint,
    candidates: list[Candidate],
    plan: Plan | None,
) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(highlight=False, soft_wrap=False, width=max(Console().width, 150))
    what = workload.example or workload.model
    batch = workload.batch_size
    devices = ", ".join(
        f"{t.name} {format_bytes(t.memory_bytes)}{'' if t.real else ' (hypothetical)'}"
        for t in targets
    )
    console.print(
        f"[bold]{what}[/bold], batch {workload.batch_size}, {workload.optimizer}, "
        f"{workload.precision} on {devices}"
    )
    console.print(
        f"model states {format_bytes(footprint.state_bytes)} (parameters "
        f"{format_bytes(footprint.param_bytes)}, gradients {format_bytes(footprint.grad_bytes)}, "
        f"optimizer {format_bytes(footprint.optimizer_bytes)}); activations "
        f"{format_bytes(footprint.activations(batch))} at batch {batch} "
        f"({format_bytes(footprint.activations(batch, True))} checkpointed; "
        f"{footprint.source}); usable = memory less {HEADROOM:.0%} headroom"
    )
    table = Table(show_lines=False)
    for column in (
        "strategy",
        "devices",
        "micro x accum",
        "per device",
        "usable",
        "fits",
        "est. time",
        "note",
    ):
        table.add_column(
            column, justify="right" if column in ("per device", "usable", "est. time") else "left"
        )
    for c in candidates:
        chosen = plan is not None and c is plan.chosen
        need_text = _per_device(c.per_device_bytes) if c.applicable else "-"
        table.add_row(
            ("> " if chosen else "") + c.label,
            str(len(c.devices)),
            f"{c.micro_batch} x {c.accumulate}",
            need_text,
            _per_device(c.usable_bytes),
            "yes" if c.fits else "no",
            f"{c.time_factor:.2f}x" if c.applicable else "-",
            c.note,
            style="bold green" if chosen else None,
        )
    console.print(table)
    if plan is None:
        return
    console.print(f"[bold]plan:[/bold] {plan.reason}")
    if plan.command is not None:
        console.print("[bold]run:[/bold]  " + escape(plan.command), soft_wrap=True)
    elif plan.python is not None:
        console.print(
            "[bold]run:[/bold]  set your model up with torchgpu's Python API (or give "
            "`torchgpu train --model ... --data ... --loss ...` the same settings as flags):",
            soft_wrap=True,
        )
        console.print(textwrap.indent(plan.python, "    "), soft_wrap=True, markup=False)
