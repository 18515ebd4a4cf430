"""Pick the plan: among the strategies that fit, the one with the least estimated slowdown.

The rule is "fit with the least slowdown", made concrete by the step-time factors of
:mod:`torchgpu.planning.candidates` (relative to one device doing the whole batch). With
``N >= 2`` equal devices and the default factors the preference order comes out as

1. ``ddp`` -- every device computes, gradients all-reduced during backward (~1.05/N);
2. ``ddp + accumulation`` -- same arithmetic in smaller micro-batches (~3% per halving);
3. ``fsdp`` (+ accumulation) -- model states sharded, gathers overlapped (~1.2/N);
4. ``ddp + checkpointing``, then ``fsdp + checkpointing`` -- one extra forward (x4/3);
5. ``pipeline`` -- stages on all devices, bubble ``(N-1)/(M+N-1)`` and recompute
   (e.g. ~0.76 for N=2, M=8, close to the seeds' measured 1.5x over one GPU);
6. ``single`` variants on the largest device (1.0, x4/3 with checkpointing);
7. ``model`` (split) -- one device busy at a time plus transfers (~1.07, the seeds' 7%).

Accumulation comes before checkpointing because it repeats no work (its cost is only
smaller kernels), and both come before splitting the model because data parallelism
keeps every device busy. A plain split is last: it is never faster than one device and
a pipeline over the same cut is. One exception: a model whose whole single-device step
needs at most :data:`SMALL_STEP_BYTES` trains on one device, since for it process start-up
and per-step communication cost more than the compute they would share.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from torchgpu.errors import PlanError
from torchgpu.planning.candidates import Candidate, all_candidates
from torchgpu.planning.commands import TrainSettings
from torchgpu.planning.footprint import Footprint
from torchgpu.planning.targets import HEADROOM, DeviceTarget
from torchgpu.sizes import format_bytes

#: A step this small (model states + activations) gains nothing from more devices.
SMALL_STEP_BYTES = 256 * 1024**2

# Ties in estimated time go to the simpler strategy.
_SIMPLICITY = {"single": 0, "ddp": 1, "fsdp": 2, "pipeline": 3, "model": 4}


@dataclass(frozen=True)
class Plan:
    """The chosen way to train, with the evidence.

    Read by ``torchgpu train --strategy auto``: ``strategy`` (``single|ddp|fsdp|model|
    pipeline``), ``micro_batch`` (per process and micro-step: ``--batch-size``),
    ``accumulate`` (``--accumulate``), ``activation_checkpointing``, ``devices`` (names
    of the devices used), ``nproc`` (processes to start), ``chunks`` and ``balance`` (for
    pipeline/model), ``effective_batch`` (samples per optimizer step over all
    processes), ``reason`` (one paragraph), ``settings`` (the ``torchgpu train``
    settings that run it, :func:`torchgpu.planning.commands.train_settings`; what
    ``--strategy auto`` applies), ``command`` (the exact ``torchgpu train`` line made
    from ``settings``, or None for a custom model ``torchgpu train`` cannot load),
    ``python`` (for a custom model: the same settings as torchgpu calls, else None),
    ``candidates`` (every row of the table) and ``targets`` (the devices with their
    memory).
    """

    strategy: str
    micro_batch: int
    accumulate: int
    activation_checkpointing: bool
    devices: tuple[str, ...]
    nproc: int
    chunks: int | None
    balance: tuple[int, ...] | None
    batch_size: int
    effective_batch: int
    reason: str
    settings: TrainSettings
    command: str | None
    python: str | None
    chosen: Candidate
    candidates: tuple[Candidate, ...]
    targets: tuple[DeviceTarget, ...]
    footprint: Footprint


def _order(candidate: Candidate) -> tuple[float, int, int]:
    return (candidate.time_factor, _SIMPLICITY.get(candidate.strategy, 9), candidate.peak_bytes)


def choose(
    candidates: Sequence[Candidate],
    footprint: Footprint,
    targets: Sequence[DeviceTarget],
    *,
    precision: str = "fp32",
) -> tuple[Candidate, str]:
    """The candidate to run and why (one paragraph). Pure.

    Raises :class:`PlanError` with the numbers when no candidate fits; it suggests
    ``--precision bf16`` only for an fp32 ``precision`` whose activations are the part
    that overflows (see :func:`bf16_would_fit`).
    """
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        raise _nothing_fits(candidates, footprint, targets, precision)
    single = next((c for c in candidates if c.label == "single"), None)
    if single is not None and single.fits and single.peak_bytes <= SMALL_STEP_BYTES:
        return single, (
            f"single on {single.devices[0]}: the whole step needs "
            f"{format_bytes(single.peak_bytes)} "
            f"(at most {format_bytes(SMALL_STEP_BYTES)} counts as small), so more devices would "
            "spend more on process start-up and communication than they save."
        )
    best = min(fitting, key=_order)
    parts = [
        f"{best.label} on {_devices_text(best.devices)}: needs {_need_text(best)}, and has "
        "the least estimated slowdown "
        f"({best.time_factor:.2f}x one device's step time) of the {len(fitting)} strategies "
        "that fit"
    ]
    if single is not None and not single.fits:
        parts.append(
            f"single needs {format_bytes(single.peak_bytes)} but the largest device has "
            f"{format_bytes(max(single.usable_bytes))} usable"
        )
    requested = footprint_batch(candidates)
    if best.effective_batch != requested:
        parts.append(f"the effective batch becomes {best.effective_batch} (requested {requested})")
    if best.note:
        parts.append(best.note)
    return best, "; ".join(parts) + "."


def _need_text(row: Candidate) -> str:
    """``"1.4 GiB per device of 14.4 GiB usable"``, or each device's when they differ."""
    if len(set(row.per_device_bytes)) <= 1 and len(set(row.usable_bytes)) <= 1:
        return (
            f"{format_bytes(row.peak_bytes)} per device of "
            f"{format_bytes(min(row.usable_bytes))} usable"
        )
    return ", ".join(
        f"{format_bytes(need)} of {format_bytes(room)} usable on {name}"
        for name, need, room in zip(
            row.devices, row.per_device_bytes, row.usable_bytes, strict=True
        )
    )


def footprint_batch(candidates: Sequence[Candidate]) -> int:
    """The requested batch: the plain single row's effective batch."""
    for c in candidates:
        if c.label == "single":
            return c.effective_batch
    return candidates[0].effective_batch if candidates else 0


def _devices_text(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{len(names)} devices ({', '.join(names)})"


def bf16_would_fit(
    candidates: Sequence[Candidate], footprint: Footprint, targets: Sequence[DeviceTarget]
) -> Candidate | None:
    """The best row that would fit if the activations (and backward's temporaries) took
    half the bytes, as bf16/fp16 autocast roughly makes them, or None.

    Mixed precision keeps fp32 weights, gradients and optimizer state, so when those
    model states are what overflows, halving the activations rescues nothing and
    ``--precision bf16`` is not worth suggesting.
    """
    halved = dataclasses.replace(
        footprint,
        activation_bytes=footprint.activation_bytes // 2,
        checkpointed_activation_bytes=footprint.checkpointed_activation_bytes // 2,
        transient_bytes=footprint.transient_bytes // 2,
        layers=tuple(
            dataclasses.replace(
                layer,
                activation_bytes=layer.activation_bytes // 2,
                input_bytes=layer.input_bytes // 2,
            )
            for layer in footprint.layers
        ),
    )
    rows = all_candidates(halved, targets, footprint_batch(candidates))
    return min((c for c in rows if c.fits), key=_order, default=None)


def _nothing_fits(
    candidates: Sequence[Candidate],
    footprint: Footprint,
    targets: Sequence[DeviceTarget],
    precision: str,
) -> PlanError:
    largest = max(targets, key=lambda t: t.usable_bytes)
    applicable = [c for c in candidates if c.applicable] or list(candidates)
    closest = min(applicable, key=lambda c: c.worst_fill)
    single = next((c for c in candidates if c.label == "single"), closest)
    fix = "Fix: use more or larger devices (--devices) or a smaller model"
    if precision == "fp32":
        rescued = bf16_would_fit(candidates, footprint, targets)
        if rescued is not None:
            fix = (
                "Fix: use more or larger devices (--devices), a smaller model, or lower "
                f"precision (--precision bf16): activations are the part that overflows, and "
                f"at half their size {rescued.label} would fit"
            )
        else:
            fix += (
                " (lower precision would not help: it keeps fp32 weights, gradients and "
                "optimizer state, and even with half the activation bytes nothing fits)"
            )
    return PlanError(
        f"no strategy fits the model on {_devices_text([t.name for t in targets])}: one device "
        f"needs {format_bytes(single.peak_bytes)} for the whole step (model states "
        f"{format_bytes(footprint.state_bytes)}), the closest, {closest.label} at micro-batch "
        f"{closest.micro_batch}, needs {format_bytes(closest.peak_bytes)} on one device, and the "
        f"largest device has {format_bytes(largest.usable_bytes)} usable "
        f"({format_bytes(largest.memory_bytes)} less {HEADROOM:.0%} headroom). {fix}."
    )
