"""Pipelines across processes: one rank per stage on ``torch.distributed.pipelining``.

The model is cut as in :func:`torchgpu.parallel.model.split_model` (same balance
rules); rank ``r`` keeps its stage(s) and hands them to torch's ``PipelineStage``;
the schedule (``ScheduleGPipe``, ``Schedule1F1B`` or ``ScheduleInterleaved1F1B``)
moves activations and gradients between ranks with the process group's
point-to-point operations — gloo on CPU, NCCL on GPU. Launch with torchrun::

    torchrun --nproc-per-node 2 -m torchgpu.parallel.stages_demo --configs gpipe:4

Per step, rank 0 gives the input batch, the last rank the target; both are split
into ``chunks`` micro-batches along dim 0 (``torch.tensor_split`` sizes). torch's
stages size their receive buffers from the first micro-batch they see and keep them
(uneven micro-batches are not supported there), so every distinct micro-batch shape
gets its own stages and schedule over the same modules, and a batch that ``chunks``
does not divide runs as two schedules of equal micro-batches back to back (batch 10,
chunks 4: two of 3 rows, then two of 2). Each micro-batch's loss is weighted by its
rows / batch rows and torch's gradient division is off (``scale_grads=False``), so
with a loss that averages over rows the summed loss and the gradients equal the
single-process full-batch ones for every batch size. A run of fewer micro-batches
than 1F1B needs runs as GPipe (interleaved: looped BFS) — the same gradients. A new
stage's shape inference (torch runs the stage once) leaves the module's buffers, e.g.
BatchNorm's running statistics, untouched.

The schedule rules are :mod:`torchgpu.parallel.stage_schedules`; the split-size sweep
across ranks is :mod:`torchgpu.parallel.stage_chunks`.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from torchgpu.errors import ConfigError, DistributedError
from torchgpu.parallel.chunks import micro_batch_groups
from torchgpu.parallel.microbatch import batch_size
from torchgpu.parallel.model import (
    BalanceSpec,
    check_shared_state,
    named_layers,
    resolve_balance,
)
from torchgpu.parallel.stage_forward import StageForward, stage_class
from torchgpu.parallel.stage_schedules import check_schedule, stage_indices

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleMulti,
        PipelineScheduleSingle,
    )
    from torch.distributed.pipelining.stage import _PipelineStageBase

__all__ = ["MAX_CACHED_SHAPES", "StagePipeline", "partition"]

#: Batch shapes whose schedules (and torch stages) are kept; the least recent is dropped.
MAX_CACHED_SHAPES = 8


def partition(
    module: nn.Module | Sequence[nn.Module], balance: Sequence[int]
) -> list[nn.Sequential]:
    """Cut ``module``'s layers into stages of ``balance`` layers; each stage keeps the
    layers' names, so its state_dict keys are the model's (``"4.weight"``)."""
    _, named = named_layers(module)
    names = [name for name, _ in named]
    layers = [layer for _, layer in named]
    out, start = [], 0
    for size in balance:
        out.append(
            nn.Sequential(
                OrderedDict(
                    zip(names[start : start + size], layers[start : start + size], strict=True)
                )
            )
        )
        start += size
    return out


class StagePipeline:
    """This rank's share of a multi-process pipeline.

    Build it on every rank with the same model (same seed or weights) after the
    process group exists. ``step(x, target)`` runs one forward+backward of the whole
    batch over all ranks (rank 0 uses ``x``, the last rank ``target``) and returns the
    batch loss on the last rank, None elsewhere; :meth:`forward` runs the forward pass
    only. Any batch size works, also one that ``chunks`` does not divide or that differs
    from the previous batch (see the module docstring). Gradients accumulate in
    :meth:`parameters`; step the optimizer yourself. ``balance`` counts layers per
    *stage* (ranks x stages_per_rank); ``"size"``/``"time"`` are measured on rank 0 with
    ``sample`` and broadcast so every rank cuts identically.

    ``autocast``: a context (e.g. :meth:`torchgpu.precision.Precision.autocast`) that
    each stage's forward and the last stage's loss run in -- never the backward, which
    the schedule runs outside it, as autocast requires. ``forward_label``: a profiler
    annotation (``torch.profiler.record_function``) around each stage's forward.
    """

    def __init__(
        self,
        module: nn.Module | Sequence[nn.Module],
        *,
        device: torch.device | str,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        schedule: str = "gpipe",
        chunks: int = 1,
        balance: BalanceSpec = None,
        stages_per_rank: int = 1,
        sample: object | None = None,
        group: dist.ProcessGroup | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        autocast: Callable[[], AbstractContextManager[Any]] | None = None,
        forward_label: str | None = None,
    ) -> None:
        self.rank = rank if rank is not None else dist.get_rank(group)
        self.world_size = world_size if world_size is not None else dist.get_world_size(group)
        check_schedule(schedule, chunks, self.world_size, stages_per_rank)
        self.schedule_name, self.stages_per_rank = schedule, stages_per_rank
        self.device, self.loss_fn, self.group = torch.device(device), loss_fn, group
        self.num_stages = self.world_size * stages_per_rank
        _, named = named_layers(module)
        layers = [layer for _, layer in named]
        counts = self._agree_balance(layers, balance, sample)
        # Each rank trains its own copy of its layers: a tensor shared by layers on two
        # ranks (a reused module, tied weights) would become two tensors that drift apart.
        ranks = [s % self.world_size for s, size in enumerate(counts) for _ in range(size)]
        check_shared_state([name for name, _ in named], layers, ranks, what="rank")
        stages = partition(module, counts)
        self.balance: tuple[int, ...] = tuple(counts)
        self.indices = stage_indices(self.rank, self.world_size, stages_per_rank)
        self.modules: list[nn.Sequential] = [stages[i].to(self.device) for i in self.indices]
        self.is_first = 0 in self.indices
        self.is_last = self.num_stages - 1 in self.indices
        # (training?, micro-batches, rows each) -> torch schedule over fresh stages
        self._built: OrderedDict[
            tuple[bool, int, int], PipelineScheduleSingle | PipelineScheduleMulti
        ] = OrderedDict()
        self._chunks = chunks
        self._autocast: Callable[[], AbstractContextManager[Any]] = autocast or nullcontext
        # What torch's stages run: each stage module, its output checked on the first call,
        # in autocast / a profiler mark if asked.
        self._runs: list[nn.Module] = [
            StageForward(m, autocast, forward_label, index=i, last=i == self.num_stages - 1)
            for i, m in zip(self.indices, self.modules, strict=True)]
        self._batch_rows = 0  # rows of the batch in flight: the loss weights' denominator
        self._weight = 1.0  # step(weight=): the batch loss's factor in the gradients

    def _agree_balance(
        self, layers: list[nn.Module], balance: BalanceSpec, sample: object
    ) -> list[int]:
        devices = [self.device] * self.num_stages
        if balance is None or not isinstance(balance, str):
            return resolve_balance(layers, devices, balance, sample)
        box: list[Any] = [
            resolve_balance(layers, devices, balance, sample) if self.rank == 0 else None
        ]
        if dist.is_initialized():
            dist.broadcast_object_list(box, src=0, group=self.group)
        return list(box[0])

    @property
    def chunks(self) -> int:
        """Micro-batches per step."""
        return self._chunks

    @chunks.setter
    def chunks(self, value: int) -> None:
        check_schedule(self.schedule_name, value, self.world_size, self.stages_per_rank)
        self._chunks = value

    def group_schedule(self, count: int) -> str:
        """The schedule that runs a run of ``count`` equal micro-batches: the configured
        one, except 1F1B below the stage count -> ``gpipe`` and interleaved 1F1B with
        ``count`` not a multiple of the ranks -> ``loopedbfs`` (same gradients)."""
        if self.schedule_name == "1f1b" and count < self.num_stages:
            return "gpipe"
        if self.schedule_name == "interleaved1f1b" and count % self.world_size:
            return "loopedbfs"
        return self.schedule_name

    def _schedule(
        self, training: bool, count: int, each: int
    ) -> PipelineScheduleSingle | PipelineScheduleMulti:
        """torch's schedule for ``count`` micro-batches of ``each`` rows, built once per
        shape on new ``PipelineStage``s over the same modules: a stage fixes its receive
        buffers' shapes at its first step, so another shape needs other stages."""
        key = (training, count, each)
        if key in self._built:
            self._built.move_to_end(key)
            return self._built[key]
        from torch.distributed.pipelining import (
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleLoopedBFS,
        )

        stages: list[_PipelineStageBase] = [
            stage_class()(m, i, self.num_stages, self.device, group=self.group)
            for m, i in zip(self._runs, self.indices, strict=True)
        ]
        kind = self.group_schedule(count) if training else "gpipe"
        # scale_grads=False: the loss is pre-weighted by rows/batch rows, and torch's
        # division by the micro-batch count would also shrink gradients accumulated earlier.
        # A forward-only schedule needs it too: torch divides every .grad at the end of
        # each step, whether or not a backward ran.
        loss_fn = self._weighted_loss(each) if training else None
        scale_grads = False
        sched: PipelineScheduleSingle | PipelineScheduleMulti
        if self.stages_per_rank > 1:
            multi = ScheduleInterleaved1F1B if kind == "interleaved1f1b" else ScheduleLoopedBFS
            sched = multi(stages, n_microbatches=count, loss_fn=loss_fn, scale_grads=scale_grads)
        elif kind == "1f1b":
            sched = Schedule1F1B(
                stages[0], n_microbatches=count, loss_fn=loss_fn, scale_grads=scale_grads
            )
        else:
            sched = ScheduleGPipe(
                stages[0], n_microbatches=count, loss_fn=loss_fn, scale_grads=scale_grads
            )
        self._built[key] = sched
        if len(self._built) > MAX_CACHED_SHAPES:  # same order on every rank: same batches
            self._built.popitem(last=False)
        return sched

    def _weighted_loss(self, each: int) -> Callable[[object, object], torch.Tensor]:
        def loss(output: object, target: object) -> torch.Tensor:
            with self._autocast():  # as one process computes it: beside the forward
                value = self.loss_fn(output, target)
            return value * (each * self._weight / self._batch_rows)

        return loss

    def _rows(self, x: object, target: object, rows: int | None, training: bool) -> int:
        """The batch's rows, agreed on every rank (see :meth:`step`)."""
        if self.is_first and not isinstance(x, torch.Tensor):
            raise ConfigError(
                f"rank {self.rank} holds the first stage, so it needs the input batch: "
                f"call step(x, ...) / forward(x) with a tensor, got {type(x).__name__}"
            )
        if training and self.is_last and not isinstance(target, torch.Tensor):
            raise ConfigError(
                f"rank {self.rank} holds the last stage, so it needs the labels: call "
                f"step(x, target) with a tensor, got {type(target).__name__}"
            )
        # (x and target are tensors where needed: checked just above)
        seen = {"x": int(x.shape[0])} if self.is_first and isinstance(x, torch.Tensor) else {}
        if training and self.is_last and isinstance(target, torch.Tensor):
            seen["target"] = int(target.shape[0])
        if rows is not None:
            if isinstance(rows, bool) or not isinstance(rows, int):
                raise ConfigError(f"rows={rows!r} must be the batch's row count (an int)")
            seen["rows"] = rows
        if len(set(seen.values())) > 1:
            raise ConfigError(
                f"the batch sizes disagree on rank {self.rank} "
                f"({', '.join(f'{k} has {v} rows' for k, v in seen.items())}): pass the "
                "same batch's input, labels and rows"
            )
        n = next(iter(seen.values()), 0)
        # Every rank must learn n; without rows= the ranks that lack x (and the labels)
        # take rank 0's. rows= must be given on every rank or on none (one collective).
        lacking = self.world_size > (2 if training else 1)
        if rows is None and lacking and dist.is_initialized():
            n = self._broadcast_rows(n, seen)
        if n < 1:
            raise ConfigError(
                f"a batch of {n} rows cannot run through the pipeline: give at least one "
                "row (and rows=N on ranks without the input or labels)"
            )
        return n

    def _broadcast_rows(self, n: int, seen: dict[str, int]) -> int:
        on = self.device if self.device.type == "cuda" else torch.device("cpu")
        box = torch.tensor([n if self.rank == 0 else 0], dtype=torch.int64, device=on)
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast(box, src=src, group=self.group)
        agreed = int(box.item())
        if seen and agreed != n:
            raise ConfigError(
                f"rank 0's input has {agreed} rows but rank {self.rank}'s batch has {n}: "
                "every rank must step the same batch"
            )
        return agreed

    def step(
        self, x: object = None, target: object = None, *, rows: int | None = None,
        weight: float = 1.0,
    ) -> torch.Tensor | None:
        """One forward+backward of the whole batch; the batch loss on the last rank.

        The batch splits into ``chunks`` micro-batches (``torch.tensor_split`` sizes);
        when ``chunks`` does not divide it, the larger micro-batches run as one schedule
        and the rest as a second, right after. Each micro-batch's loss is weighted by its
        share of the rows, so with a loss that averages over rows the returned loss and
        the gradients equal the single-process full-batch ones. ``rows`` is the batch's
        row count: pass it on every rank or on none (then, with more than two ranks, one
        small broadcast from rank 0 tells the middle ranks). ``weight`` multiplies the
        batch loss in the gradients only (e.g. the batch's rows, to weight batches of
        different sizes by their samples when accumulating; the same on every rank)."""
        if not (isinstance(weight, (int, float)) and 0 < weight < math.inf):
            raise ConfigError(f"weight={weight!r} must be a positive finite number")
        n = self._rows(x, target, rows, training=True)
        self._batch_rows, self._weight = n, float(weight)
        losses: list[torch.Tensor] = []
        start = 0
        for count, each in micro_batch_groups(n, self._chunks):
            sched, stop = self._schedule(True, count, each), start + count * each
            # (_rows checked that the first rank has a tensor x, the last a tensor target)
            tensor_x = x if self.is_first and isinstance(x, torch.Tensor) else None
            args = (tensor_x[start:stop].to(self.device),) if tensor_x is not None else ()
            if self.is_last and isinstance(target, torch.Tensor):
                got: list[torch.Tensor] = []
                sched.step(*args, target=target[start:stop].to(self.device), losses=got)
                losses += got
            else:
                sched.step(*args)
            start = stop
        if not self.is_last:
            return None
        return torch.stack([loss.detach() for loss in losses]).sum() / self._weight

    def forward(
        self, x: object = None, *, rows: int | None = None, chunks: int | None = None
    ) -> Any:  # the last layer's output
        """The model's output for the batch ``x`` on the last rank (None elsewhere): the
        forward pass only, without gradients, in ``chunks`` micro-batches (default
        :attr:`chunks`; in a one-process group the stages simply run in order). ``rows``:
        as in :meth:`step` (ranks without ``x`` need it, or it is broadcast from rank 0)."""
        m = self._chunks if chunks is None else chunks
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ConfigError(f"chunks={m!r} must be a positive integer (micro-batches)")
        n = self._rows(x, None, rows, training=False)
        outputs: list[object] = []
        start = 0
        with torch.no_grad():
            # (_rows checked that the first rank, the only one with one stage, has a tensor)
            if self.world_size == 1 and isinstance(x, torch.Tensor):  # nothing to pipeline
                return nn.Sequential(*self._runs)(x.to(self.device))
            for count, each in micro_batch_groups(n, m):
                stop = start + count * each
                tensor_x = x if self.is_first and isinstance(x, torch.Tensor) else None
                args = (tensor_x[start:stop].to(self.device),) if tensor_x is not None else ()
                outputs.append(self._schedule(False, count, each).step(*args))
                start = stop
        if not self.is_last:
            return None
        out = outputs[0] if len(outputs) == 1 else _concat(outputs)
        got = batch_size(out)
        if got != n:  # a receive buffer of another shape would leave stale rows
            raise DistributedError(
                f"the pipeline returned {got} rows for a batch of {n}: the stages "
                "disagree on the batch; every rank must run the same batches"
            )
        return out

    def parameters(self) -> Iterator[nn.Parameter]:
        """Parameters of this rank's stage(s)."""
        for m in self.modules:
            yield from m.parameters()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's weights under the model's own keys (merge ranks for the whole model)."""
        out: dict[str, torch.Tensor] = {}
        for m in self.modules:
            out.update(m.state_dict())
        return out

    def train(self, mode: bool = True) -> StagePipeline:
        for m in self.modules:
            m.train(mode)
        return self


def _concat(parts: list[Any]) -> Any:  # the last layer's outputs
    """Join outputs along dim 0 (tensors, or tuples/lists of them)."""
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    return type(parts[0])(_concat(list(items)) for items in zip(*parts, strict=True))
