"""Every strategy's memory per device and estimated step time: pure arithmetic on a Footprint.

Memory per device (bytes; ``S`` = parameters + gradients + optimizer state, ``A(b)`` /
``Ack(b)`` = activations saved for backward at ``b`` samples without / with activation
checkpointing, ``T(b)`` = the peak's temporaries, ``N`` devices, ``B`` the batch):

- ``single``: ``S + A(B) + T(B)`` on the largest device.
- ``ddp``: per rank ``S + G + A(B/N) + T(B/N)``; ``G`` because DDP's communication
  buckets hold a second copy of the gradients (``gradient_as_bucket_view=False``).
- ``fsdp``: per rank ``S/N + 2 P_max + G_max + A(B/N) + T(B/N)``: states sharded, plus
  the largest unit's parameters gathered (the current one and the prefetched next) and
  its unsharded gradients; without layers the whole model is one unit.
- ``model`` (split): the layers cut into contiguous stages balanced by memory (each
  stage's need over its device's usable memory, minimised); stage ``S_i + A_i(B) + T(B)``.
- ``pipeline``: the same cut with ``M`` chunks, GPipe fill-drain, checkpointing all
  chunks but the last: stage ``S_i + In_i(B) + 2 A_i(B/M) + T(B/M)`` (every chunk's
  stage input kept, one chunk recomputed at a time, the last chunk's activations kept).

``+ accumulation`` halves the micro-batch (the :class:`torchgpu.memory.oom.OOMBackoff`
sequence) until it fits, keeping the effective batch; ``+ checkpointing`` uses ``Ack``.

Step time is estimated relative to the whole batch on one device (:data:`COSTS`),
for compute-bound steps: data parallelism divides it by ``N`` (plus communication),
checkpointing adds one forward (~1/3 of forward + backward), each halving of the
micro-batch loses a little device efficiency, a pipeline idles in its bubble
``(N-1)/(M+N-1)``, and a plain split keeps one device busy at a time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torchgpu.memory.oom import split_batch
from torchgpu.planning.footprint import Footprint, LayerFootprint
from torchgpu.planning.targets import DeviceTarget


@dataclass(frozen=True)
class Costs:
    """Relative step-time factors (see the module docstring); 1.0 = no slowdown."""

    ddp_comm: float = 1.05  # all-reduce overlapped with backward: a few percent
    fsdp_comm: float = 1.20  # all-gather twice + reduce-scatter, mostly overlapped
    checkpointing: float = 4.0 / 3.0  # one extra forward ~ 1/3 of forward + backward
    per_halving: float = 0.03  # smaller micro-batches use the device less fully
    split_transfer: float = 1.07  # the seeds' ResNet-50 split: 7% slower than one GPU
    pipeline_transfer: float = 1.05


COSTS = Costs()
#: Chunks per pipeline stage; GPipe's rule of thumb M >= 4N keeps the bubble under ~20%.
CHUNKS_PER_STAGE = 4


@dataclass(frozen=True)
class Candidate:
    """One row of the plan table: a strategy with its settings, memory and time.

    ``micro_batch`` is per process and micro-step (the ``--batch-size`` of
    ``torchgpu train``; for split/pipeline the whole batch a step feeds, which a
    pipeline cuts into ``chunks``); ``effective_batch`` counts every process.
    ``per_device_bytes[i]`` is the need on ``devices[i]``; ``usable_bytes[i]`` its room.
    ``time_factor`` is the estimated step time relative to one device (lower is faster).
    ``applicable`` is False when the strategy cannot run here (``note`` says why).
    """

    label: str
    strategy: str
    devices: tuple[str, ...]
    micro_batch: int
    accumulate: int
    checkpointing: bool
    per_device_bytes: tuple[int, ...]
    usable_bytes: tuple[int, ...]
    time_factor: float
    effective_batch: int
    chunks: int | None = None
    balance: tuple[int, ...] | None = None
    applicable: bool = True
    note: str = ""

    @property
    def fits(self) -> bool:
        """Applicable and every device's need within its usable memory."""
        return self.applicable and all(
            need <= room
            for need, room in zip(self.per_device_bytes, self.usable_bytes, strict=True)
        )

    @property
    def peak_bytes(self) -> int:
        """The largest need on any device (bytes)."""
        return max(self.per_device_bytes, default=0)

    @property
    def worst_fill(self) -> float:
        """The largest need/usable ratio over the devices (> 1: does not fit)."""
        return max(
            (
                need / max(room, 1)
                for need, room in zip(self.per_device_bytes, self.usable_bytes, strict=True)
            ),
            default=math.inf,
        )


def halvings(micro: int, effective: int) -> list[tuple[int, int]]:
    """The back-off sequence ``[(micro, accumulate), ...]`` from ``micro`` down to 1,
    keeping ``effective`` samples per step (the rule of :func:`torchgpu.memory.oom.split_batch`)."""
    out = [(micro, max(1, effective // micro))]
    while micro > 1:
        split = split_batch(effective, math.ceil(micro / 2))
        micro = split.micro_batch
        out.append((micro, split.accumulate))
    return out


def _accum_factor(accumulate: int, costs: Costs) -> float:
    return 1.0 + costs.per_halving * math.log2(accumulate) if accumulate > 1 else 1.0


def data_parallel_candidates(
    fp: Footprint, devices: Sequence[DeviceTarget], batch: int, costs: Costs = COSTS
) -> list[Candidate]:
    """single (on the largest device) and, with 2+ devices, ddp and fsdp over all of them;
    each plain, + checkpointing, + accumulation, + both."""
    out: list[Candidate] = []
    biggest = max(devices, key=lambda d: d.usable_bytes)
    modes = ["single"] + (["ddp", "fsdp"] if len(devices) > 1 else [])
    for mode in modes:
        used = [biggest] if mode == "single" else list(devices)
        n = len(used)
        share = math.ceil(batch / n)  # samples per rank per step
        for checkpointing in (False, True):
            for accumulation in (False, True):
                out.append(
                    _data_parallel(fp, mode, used, batch, share, checkpointing, accumulation, costs)
                )
    return out


def _need(fp: Footprint, mode: str, n: int, micro: int, checkpointing: bool) -> int:
    step_ws = fp.step_workspace_bytes if mode != "fsdp" else math.ceil(fp.step_workspace_bytes / n)
    act = fp.working(micro, checkpointing, step_ws)
    if mode == "single":
        return fp.state_bytes + act
    if mode == "ddp":
        return fp.state_bytes + fp.grad_bytes + act
    unit = fp.largest_layer()
    gathered = (
        2 * unit.param_bytes + unit.grad_bytes
        if unit is not None
        else fp.param_bytes + fp.grad_bytes
    )
    return math.ceil(fp.state_bytes / n) + gathered + act


def _data_parallel(
    fp: Footprint,
    mode: str,
    used: list[DeviceTarget],
    batch: int,
    share: int,
    checkpointing: bool,
    accumulation: bool,
    costs: Costs,
) -> Candidate:
    n = len(used)
    label = (
        mode
        + (" + checkpointing" if checkpointing else "")
        + (" + accumulation" if accumulation else "")
    )
    room = min(d.usable_bytes for d in used)
    steps = halvings(share, share) if accumulation else [(share, 1)]
    micro, accumulate = steps[-1]
    for m, k in steps:  # the first (largest) micro-batch that fits
        if _need(fp, mode, n, m, checkpointing) <= room:
            micro, accumulate = m, k
            break
    if accumulation and accumulate == 1 and len(steps) > 1:
        micro, accumulate = steps[1]  # plain already fits: show the first halving's numbers
    need = _need(fp, mode, n, micro, checkpointing)
    time = 1.0 if mode == "single" else (costs.ddp_comm if mode == "ddp" else costs.fsdp_comm) / n
    time *= costs.checkpointing if checkpointing else 1.0
    time *= _accum_factor(accumulate, costs)
    notes = []
    applicable = True
    if batch < n:
        applicable = False
        notes.append(f"batch {batch} is smaller than {n} ranks")
    elif share * n != batch:
        notes.append(f"{n} x {share} = {share * n} samples per step, not {batch}")
    if accumulation and share == 1:
        applicable = False
        notes.append("micro-batch already 1")
    if checkpointing and not fp.checkpointable:
        applicable = False
        notes.append("no layers or repeated block to checkpoint")
    return Candidate(
        label=label,
        strategy=mode,
        devices=tuple(d.name for d in used),
        micro_batch=micro,
        accumulate=accumulate,
        checkpointing=checkpointing,
        per_device_bytes=tuple(need for _ in used),
        usable_bytes=tuple(d.usable_bytes for d in used),
        time_factor=time,
        effective_batch=micro * accumulate * n,
        applicable=applicable,
        note="; ".join(notes),
    )


def partition_by_capacity(costs: Sequence[float], capacities: Sequence[float]) -> list[int]:
    """Cut ``costs`` (per layer) into ``len(capacities)`` contiguous non-empty stages,
    stage ``j`` on a device of capacity ``capacities[j]``, minimising the largest
    ``stage cost / capacity``; returns the stage sizes (a balance). Exact DP, O(N L^2).

    >>> partition_by_capacity([1, 1, 1, 1], [3, 1])
    [3, 1]
    """
    n, parts = len(costs), len(capacities)
    if parts < 1 or n < parts:
        raise ValueError(f"cannot cut {n} layers into {parts} non-empty stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    best = [[math.inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for j in range(1, parts + 1):
        cap = max(float(capacities[j - 1]), 1e-9)
        for i in range(j, n - (parts - j) + 1):
            for p in range(j - 1, i):
                value = max(best[j - 1][p], (prefix[i] - prefix[p]) / cap)
                if value < best[j][i]:
                    best[j][i], cut[j][i] = value, p
    sizes, i = [], n
    for j in range(parts, 0, -1):
        p = cut[j][i]
        sizes.append(i - p)
        i = p
    return sizes[::-1]


def _stages(layers: Sequence[LayerFootprint], balance: Sequence[int]) -> list[list[LayerFootprint]]:
    out, start = [], 0
    for size in balance:
        out.append(list(layers[start : start + size]))
        start += size
    return out


def _scaled(fp: Footprint, value: int, batch: int) -> int:
    return math.ceil(fp.per_sample(value) * batch)


def split_candidates(
    fp: Footprint, devices: Sequence[DeviceTarget], batch: int, costs: Costs = COSTS
) -> list[Candidate]:
    """``model`` (plain split) and ``pipeline`` over all devices, balanced by memory."""
    n = len(devices)
    if n < 2:
        return []
    names = tuple(d.name for d in devices)
    rooms = tuple(d.usable_bytes for d in devices)
    chunks = max(1, min(batch, CHUNKS_PER_STAGE * n))
    rows: list[Candidate] = []
    for strategy in ("model", "pipeline"):
        if len(fp.layers) < n:
            why = (
                "the model is not splittable (no as_sequential(), or batches of several "
                "inputs, which stages cannot pass on)"
                if not fp.layers
                else f"{len(fp.layers)} top-level layers cannot fill {n} stages"
            )
            rows.append(
                Candidate(
                    strategy,
                    strategy,
                    names,
                    batch,
                    1,
                    strategy == "pipeline",
                    (0,) * n,
                    rooms,
                    math.inf,
                    batch,
                    chunks if strategy == "pipeline" else None,
                    None,
                    False,
                    why,
                )
            )
            continue
        m = chunks if strategy == "pipeline" else 1
        per_layer = [_layer_need(fp, layer, batch, m, strategy) for layer in fp.layers]
        balance = partition_by_capacity(per_layer, rooms)
        needs = []
        for stage in _stages(fp.layers, balance):
            need = sum(_layer_need(fp, layer, batch, m, strategy) for layer in stage)
            if strategy == "pipeline":
                need += _scaled(fp, stage[0].input_bytes, batch)  # every chunk's stage input
                need += fp.transient(math.ceil(batch / m))
            else:
                need += fp.transient(batch)
            grads = sum(layer.grad_bytes for layer in stage)
            step_ws = math.ceil(fp.step_workspace_bytes * grads / max(fp.grad_bytes, 1))
            needs.append(max(need, sum(layer.state_bytes for layer in stage) + step_ws))
        if strategy == "pipeline":
            bubble = (m + n - 1) / (m * n)
            recompute = 1.0 + (costs.checkpointing - 1.0) * (m - 1) / m
            time = bubble * recompute * costs.pipeline_transfer
        else:
            time = costs.split_transfer
        rows.append(
            Candidate(
                label="pipeline" if strategy == "pipeline" else "model (split)",
                strategy=strategy,
                devices=names,
                micro_batch=batch,
                accumulate=1,
                checkpointing=strategy == "pipeline",
                per_device_bytes=tuple(needs),
                usable_bytes=rooms,
                time_factor=time,
                effective_batch=batch,
                chunks=m if strategy == "pipeline" else None,
                balance=tuple(balance),
                note=f"balance {list(balance)}"
                + (f", {m} chunks" if strategy == "pipeline" else ""),
            )
        )
    return rows


def _layer_need(
    fp: Footprint, layer: LayerFootprint, batch: int, chunks: int, strategy: str
) -> int:
    if strategy == "pipeline":  # one chunk recomputed + the last chunk kept
        return layer.state_bytes + 2 * _scaled(
            fp, layer.activation_bytes, math.ceil(batch / chunks)
        )
    return layer.state_bytes + _scaled(fp, layer.activation_bytes, batch)


def all_candidates(
    fp: Footprint, devices: Sequence[DeviceTarget], batch: int, costs: Costs = COSTS
) -> list[Candidate]:
    """Every row of the plan table, in a fixed order (data parallel first, then splits)."""
    return data_parallel_candidates(fp, devices, batch, costs) + split_candidates(
        fp, devices, batch, costs
    )
