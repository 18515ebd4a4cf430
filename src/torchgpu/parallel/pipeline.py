"""Pipeline: GPipe fill-drain over devices in one process.

The mini-batch is scattered into M micro-batches; at clock ``k`` stage ``j`` runs
micro-batch ``k - j`` (:func:`torchgpu.parallel.schedule.clock_cycles`). On CUDA
every stage has its own stream on its device, so work queued for different stages
overlaps — also with two stages on one GPU (``["cuda:0", "cuda:0"]``). On the CPU
the same code runs with the stream operations as no-ops: a faithful stand-in for
correctness, not a speed-up (use :mod:`torchgpu.parallel.stages` to pipeline over
CPU processes).

Stream safety (forward; autograd replays it in backward, where each op runs on the
stream of its forward op and the engine synchronises across streams):

- a stage's stream waits for the stream that produced its input
  (``wait_stream``); cross-device copies run inside both streams' contexts, and
  PyTorch's copy waits on both sides;
- a tensor made on one stream and read on another is ``record_stream``-ed on the
  reader, so the caching allocator does not hand its memory out early;
- the caller's current stream on the output device waits for the last stage before
  the micro-batch outputs are concatenated.

Transparency: outputs and gradients equal the plain model's up to float rounding,
for every M and checkpoint mode, as long as layers do not mix rows of a batch
(BatchNorm does: see :mod:`torchgpu.parallel.batchnorm`) and draw no random numbers
in an order that depends on the batch split (dropout masks differ per micro-batch).
In-place layers work anywhere, also first in a checkpointed stage (such a stage runs
on a copy of its input, so the recomputation in backward reads the original).

Values between stages are whatever the layers pass (tensors, tuples, dicts, None...),
as in the plain model. The last layer's outputs are concatenated along dim 0
(:func:`torchgpu.parallel.microbatch.gather`): tensors with the batch along dim 0
(``(rows, ...)``, or a fixed multiple such as flattened tokens), alone or in tuples,
named tuples, lists and dicts, next to values every micro-batch gives alike (None,
strings, flags). Anything else (no tensor at all, a 0-dimensional loss, a tensor
whose dim 0 is not the batch, a number such as a row count) is refused with a
``MicroBatchTypeError`` (a ``TypeError``) naming the layer and the value, for every M;
a tensor whose batch may lie after dim 0 (sequence-first, ``x.t()``) is also refused
whenever micro-batches of equal size leave that in doubt (see
:func:`torchgpu.parallel.microbatch._check_rows` for what shapes can decide).
An ``nn.Sequential`` subclass with its own ``forward`` is refused (split, it would run
as a plain Sequential): give it ``as_sequential()``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from torchgpu.errors import ConfigError
from torchgpu.memory.recompute import Recompute
from torchgpu.parallel.batchnorm import (
    DeferredBatchNorm,
    convert_deferred_batch_norm,
    deferred_layers,
    tracking,
)
from torchgpu.parallel.chunks import ChunkChoice, time_chunks
from torchgpu.parallel.microbatch import batch_size, gather, map_tensors, scatter, tensors_in
from torchgpu.parallel.model import (
    BalanceSpec,
    DeviceLike,
    SplitModel,
    move,
    named_layers,
    parse_devices,
    resolve_balance,
    split_model,
)
from torchgpu.parallel.schedule import clock_cycles

CHECKPOINT_MODES = ("never", "except_last", "always")
Stream = torch.cuda.Stream | None  # a stream on CUDA devices, None on the CPU


# ------------------------------------------------------------------ stream helpers
def new_stream(device: torch.device) -> Stream:
    """A fresh stream on a CUDA device; None (no-op) elsewhere."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]


def current_stream(device: torch.device) -> Stream:
    """The caller's current stream on ``device``; None for non-CUDA devices."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


@contextmanager
def use_stream(stream: Stream) -> Iterator[None]:
    """Make ``stream`` current on its device inside the block (no-op for None)."""
    if stream is None:
        yield
    else:
        with torch.cuda.stream(stream):
            yield


def wait_stream(waiter: Stream, source: Stream) -> None:
    """Work queued later on ``waiter`` starts after what is queued now on ``source``."""
    if waiter is not None and source is not None and waiter != source:
        waiter.wait_stream(source)


def record_stream(obj: object, stream: Stream) -> None:
    """Mark CUDA tensors in ``obj`` (also inside tuples, lists, dicts) as used on
    ``stream`` (same device only)."""
    if stream is None:
        return
    for t in tensors_in(obj):
        if t.is_cuda and t.device == stream.device:
            t.record_stream(stream)


def _device_of(obj: object) -> torch.device | None:
    tensors = tensors_in(obj)
    return tensors[0].device if tensors else None


def _check_chunks(chunks: object) -> int:
    """``chunks`` as a positive Python int: integers of any kind (numpy's too) and
    whole floats (``4.0``) are taken; anything else is refused."""
    value: int | None = None
    if not isinstance(chunks, bool):
        if isinstance(chunks, float) and chunks.is_integer():
            value = int(chunks)
        else:
            try:
                value = operator.index(chunks)  # type: ignore[arg-type]
            except TypeError:
                value = None
    if value is None or value < 1:
        raise ConfigError(
            f"chunks={chunks!r} is not a micro-batch count: use a positive integer (1 = no "
            "pipelining) or 'auto' with a sample batch to measure the fastest"
        )
    return value


class Pipeline(SplitModel):
    """GPipe over ``devices`` (one stage per entry; entries may repeat).

    Args:
        module: nn.Sequential, list of modules, or a module with ``as_sequential()``.
            Its layers are moved in place; the pipeline owns them.
        devices: e.g. ``["cuda:0", "cuda:1"]``, ``["cuda:0", "cuda:0"]`` or ``["cpu", "cpu"]``.
        balance: layers per stage, ``"size"``, ``"time"`` or None (even by count).
        chunks: micro-batches per mini-batch, or ``"auto"``: measure a few training
            steps for several M with ``sample``/``sample_target``/``loss_fn`` and keep
            the fastest (:func:`choose_chunks`; the table is
            kept in ``self.chunk_choice``). A batch smaller than M runs in fewer chunks.
        checkpoint: ``"never"``; ``"except_last"`` (every micro-batch but the last
            recomputes its stage forward in backward — the last one's backward starts
            at once); ``"always"``. Only in training mode with gradients enabled.
        deferred_batch_norm: replace BatchNorm layers by
            :class:`~torchgpu.parallel.batchnorm.DeferredBatchNorm` so running
            statistics are those of the whole mini-batch (normalisation in training
            still uses micro-batch statistics).
        sample: an input batch for ``balance="size"|"time"`` and ``chunks="auto"``.

    Labels go to ``output_device``: ``loss_fn(pipe(x), y.to(pipe.output_device))``.
    """

    def __init__(
        self,
        module: nn.Module | Sequence[nn.Module],
        devices: Sequence[DeviceLike],
        balance: BalanceSpec = None,
        chunks: int | Literal["auto"] = 1,
        checkpoint: str = "except_last",
        deferred_batch_norm: bool = False,
        sample: object | None = None,
        sample_target: object | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    ) -> None:
        if checkpoint not in CHECKPOINT_MODES:
            raise ConfigError(
                f"checkpoint={checkpoint!r} is not a checkpoint mode: use one of "
                f"{', '.join(CHECKPOINT_MODES)}"
            )
        if chunks != "auto":
            _check_chunks(chunks)
        elif sample is None or sample_target is None or loss_fn is None:
            raise ConfigError(
                "chunks='auto' measures training steps, so it needs sample=<input batch>, "
                "sample_target=<its labels> and loss_fn=<loss function>; or give chunks=M"
            )
        owner, named = named_layers(module)
        if deferred_batch_norm:
            convert_deferred_batch_norm(owner)
            owner, named = named_layers(owner)
        layers = [layer for _, layer in named]
        devs = parse_devices(devices)
        balance_sample = sample
        if sample is not None and isinstance(chunks, int):
            balance_sample = scatter(sample, chunks)[0]  # balance for the micro-batch size
        counts = resolve_balance(layers, devs, balance, balance_sample)
        super().__init__(owner, layers, devs, counts, [name for name, _ in named])
        self.checkpoint = checkpoint
        self._chunks = 1
        self._deferred: list[DeferredBatchNorm] = deferred_layers(owner)
        self._streams: list[Stream] = [new_stream(d) for d in devs]
        self.chunk_choice: ChunkChoice | None = None
        if chunks == "auto":
            assert loss_fn is not None  # checked above
            choice = time_chunks(self, sample, sample_target, loss_fn)
            self.chunk_choice, self._chunks = choice, choice.chunks
        else:
            self._chunks = _check_chunks(chunks)

    @property
    def chunks(self) -> int:
        """Micro-batches per mini-batch (fewer when the batch has fewer rows)."""
        return self._chunks

    @chunks.setter
    def chunks(self, value: int) -> None:
        self._chunks = _check_chunks(value)

    @property
    def deferred_batch_norms(self) -> list[DeferredBatchNorm]:
        """The DeferredBatchNorm layers (empty unless ``deferred_batch_norm=True``)."""
        return list(self._deferred)

    def _checkpoint_stop(self, m: int) -> int:
        """Micro-batches ``i < stop`` are checkpointed: in training mode with gradients
        enabled only (in eval mode recomputing would cost time and save nothing that
        matters, as in torchgpipe)."""
        if not (self.training and torch.is_grad_enabled()) or self.checkpoint == "never":
            return 0
        return m if self.checkpoint == "always" else m - 1

    def forward(self, x: object) -> Any:  # the last layer's output
        micro = scatter(x, self._chunks)
        m, n = len(micro), len(self.partitions)
        if m > 1 and torch.is_grad_enabled():
            # Sibling views of one tensor share its version counter, so a layer changing
            # its input in place (``x.relu_()``, ``mask.add_(1)``) on one micro-batch would
            # invalidate what autograd saved for another (the plain model modifies one
            # tensor once): every micro-batch gets its own copy of the input.
            micro = [map_tensors(torch.clone, b) for b in micro]
        stop = self._checkpoint_stop(m)
        in_device = _device_of(x) or self.devices[0]
        source_streams = [current_stream(in_device)] * m  # where each micro-batch was made
        batches: list[object] = list(micro)
        track: AbstractContextManager[None] = (
            tracking(self._deferred) if self.training else nullcontext()
        )
        with track:
            for tasks in clock_cycles(m, n):
                for i, j in tasks:
                    for layer in self._deferred:
                        layer.micro_batch = i  # which accumulator a repeated layer's call feeds
                    batches[i] = self._run_task(j, batches[i], source_streams[i], i < stop)
                    source_streams[i] = self._streams[j]
        if self.training:
            for layer in self._deferred:
                layer.commit()
        out_stream = current_stream(self.output_device)
        wait_stream(out_stream, self._streams[-1])
        for batch in batches:
            record_stream(batch, out_stream)
        last = type(self.partitions[-1][-1]).__name__
        rows = [batch_size(b) for b in micro]
        return gather(
            batches, f"the pipeline's last layer {self.layer_names[-1]!r} ({last})", rows
        )

    def _run_task(self, j: int, x: object, source: Stream, use_checkpoint: bool) -> object:
        """Stage ``j`` on one micro-batch ``x`` that was produced on stream ``source``."""
        device, stream = self.devices[j], self._streams[j]
        same_device = source is not None and stream is not None and source.device == stream.device
        with use_stream(source), use_stream(stream):
            if same_device:
                wait_stream(stream, source)
            x = move(x, device)  # cross-device copies synchronise both streams themselves
            if same_device:
                record_stream(x, stream)
            stage = self.partitions[j]
            if use_checkpoint:
                # A copy of x per run and running statistics frozen in the recompute
                # (an in-place first layer, BatchNorm counting once): memory.recompute.
                return torch_checkpoint(
                    Recompute(stage, stage), x, use_reentrant=False, preserve_rng_state=True
                )
            return stage(x)


def choose_chunks(
    module_or_pipeline: nn.Module,
    sample_input: object,
    sample_target: object,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    candidates: Sequence[int] | None = None,
    steps: int = 3,
    warmup: int = 1,
    devices: Sequence[DeviceLike] | None = None,
) -> ChunkChoice:
    """Measure training steps of a :class:`Pipeline` for each candidate M and return the
    fastest (the pipeline's ``chunks`` is left unchanged).

    ``module_or_pipeline`` is a Pipeline, or a model to wrap in one over ``devices``
    (then its layers are moved there). ``sample_input``/``sample_target`` are one real
    mini-batch. Gradients, buffers (BatchNorm statistics) and the random number
    generators are restored afterwards; the weights are never stepped.
    """
    if isinstance(module_or_pipeline, Pipeline):
        pipe = module_or_pipeline
    else:
        if devices is None:
            raise ConfigError(
                "choose_chunks on a plain model needs devices=[...] to build the pipeline "
                "(e.g. devices=['cuda:0', 'cuda:1']); or pass a Pipeline"
            )
        pipe = Pipeline(module_or_pipeline, devices)
    return time_chunks(pipe, sample_input, sample_target, loss_fn, candidates, steps, warmup)


def build_pipeline_model(
    module: nn.Module | Sequence[nn.Module],
    strategy: Literal["model", "pipeline"],
    devices: Sequence[DeviceLike],
    balance: BalanceSpec = None,
    chunks: int | Literal["auto"] = 1,
    checkpoint: str = "except_last",
    deferred_batch_norm: bool = False,
    sample: object | None = None,
    sample_target: object | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
) -> SplitModel:
    """One entry for the training loop: ``strategy="model"`` gives :func:`split_model`,
    ``"pipeline"`` a :class:`~torchgpu.parallel.pipeline.Pipeline` (``chunks="auto"``
    needs ``sample``, ``sample_target`` and ``loss_fn``)."""
    if strategy == "model":
        return split_model(module, devices, balance, sample)
    if strategy == "pipeline":
        return Pipeline(
            module,
            devices,
            balance=balance,
            chunks=chunks,
            checkpoint=checkpoint,
            deferred_batch_norm=deferred_batch_norm,
            sample=sample,
            sample_target=sample_target,
            loss_fn=loss_fn,
        )
    raise ConfigError(f"strategy {strategy!r} is not a split strategy: use 'model' or 'pipeline'")
