"""``torchgpu doctor --model module:factory --input-shape 2,3,128,128 [--devices
cuda:0,cuda:1]``: the fake-device placement check of
:func:`torchgpu.placement.check_placement` from the command line, its flags checked
first (one paragraph naming the value and the fix)."""

from __future__ import annotations

import importlib
import math
from typing import Any

from torchgpu.cli.common import parse_int
from torchgpu.errors import UsageError

#: Largest input batch the placement check builds, in elements: its fake tensors hold
#: no memory, but torch computes their size in bytes as a signed 64-bit number.
MAX_INPUT_ELEMENTS = 2**60
#: Largest GPU index a device string may name: torch keeps device indices in 8 bits
#: (cuda:128 silently becomes cuda:-128).
MAX_DEVICE_INDEX = 127


def _shape(text: str) -> tuple[int, ...]:
    parts = [p.strip() for p in text.split(",")]
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise UsageError(
            f"--input-shape {text!r} is not a shape: use positive integers separated by "
            "commas, batch first, e.g. --input-shape 2,3,128,128"
        )
    shape = tuple(parse_int("--input-shape", p, 1, MAX_INPUT_ELEMENTS, " (one dimension)")
                  for p in parts)
    if math.prod(shape) > MAX_INPUT_ELEMENTS:
        raise UsageError(
            f"--input-shape {text} holds {math.prod(shape):.3g} elements, more than the "
            f"{MAX_INPUT_ELEMENTS:.3g} (2**60) torch can size: give the shape of one real "
            "input batch, batch first, e.g. --input-shape 2,3,128,128"
        )
    return shape


def _device_list(devices: str) -> list[str]:
    """``--devices`` as a list of ``cpu``, ``cuda`` and ``cuda:N`` (N in
    0..MAX_DEVICE_INDEX), else UsageError naming the entry."""
    listed = [d.strip() for d in devices.split(",")]
    if not all(listed):
        raise UsageError(
            f"--devices {devices!r} has an empty entry: use e.g. --devices cuda:0,cuda:1"
        )
    for entry in listed:
        kind, colon, index = entry.partition(":")
        if kind not in ("cpu", "cuda") or (colon and (kind != "cuda" or not index.isdigit())):
            raise UsageError(
                f"--devices {devices!r}: {entry!r} is not a device the check can place: use "
                "cpu, cuda or cuda:N, e.g. --devices cuda:0,cuda:1"
            )
        if index:
            parse_int(f"--devices {entry}: the GPU index", index, 0, MAX_DEVICE_INDEX,
                      " (torch keeps device indices in 8 bits)")
    return listed


def check_model_placement(model: str, input_shape: str | None, devices: str | None) -> int:
    """``--model SPEC --input-shape N,... [--devices LIST]``: print the placement report;
    0 when sound, 1 when a module or tensor is on the wrong device; UsageError (exit 2)
    when it could not check."""
    if input_shape is None:
        raise UsageError(
            "--model needs --input-shape (the shape of one input batch, batch first), "
            "e.g. --input-shape 2,3,128,128"
        )
    shape = _shape(input_shape)
    device_list = _device_list(devices) if devices is not None else None
    from torchgpu.factories import resolve_factory  # imports torch: after the flags parse

    factory = resolve_factory(model)
    # Imported here: the placement check is heavy and only needed with --model.
    placement: Any = importlib.import_module("torchgpu.placement")
    report = placement.check_placement(factory, shape, device_list)
    if getattr(report, "error", None):  # not checked: the factory or --input-shape is wrong
        raise UsageError(f"--model {model}: {report.error}")
    print(report.format())
    return 0 if report.ok else 1
