"""Scatter a mini-batch into micro-batches and gather them back (dim 0).

A batch is a tensor, or a tuple/list (named tuples too) or dict of batches, nested
to any depth, holding at least one tensor; every tensor shares the first dimension.
Non-tensor values (a flag, a string, None) are handed unchanged to every micro-batch.

``scatter(batch, chunks)`` makes ``min(chunks, batch_size)`` micro-batches with
``torch.tensor_split`` sizes: as equal as possible, the first ones one row larger
when the batch does not divide (10 rows in 4 chunks -> 3, 3, 2, 2). A batch smaller
than ``chunks`` gives one row per micro-batch, never an empty one.
``gather(outputs)`` concatenates along dim 0 and restores the structure. It refuses,
with :class:`MicroBatchTypeError`, what it cannot join without changing the result: a
value holding no tensor, a 0-dimensional tensor (a loss, a sum over the batch), a
type it does not know, or a non-tensor value that differs between micro-batches;
given the micro-batches' row counts (the pipeline's output) also a tensor it cannot tell
to hold the rows along dim 0 (or one multiple of them) and any number (see
:func:`gather` and :func:`_check_rows`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from torchgpu.errors import ConfigError, MicroBatchTypeError

T = TypeVar("T")

#: Non-tensor values passed through unchanged (they must agree between micro-batches).
_PLAIN = (str, bytes, int, float, complex, bool, torch.dtype, torch.device)

_JOIN_RULE = (
    "the pipeline concatenates its micro-batches' outputs along dim 0, so the last layer "
    "must return tensors with a batch dimension (alone or in tuples, lists or dicts); "
    "other values (None, strings, flags; not numbers) pass through only when every "
    "micro-batch gives the same one"
)


def tensors_in(obj: object) -> list[torch.Tensor]:
    """The tensors inside ``obj`` (a tensor, or tuples, lists and dicts of them), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in tensors_in(item)]
    if isinstance(obj, Mapping):
        return [t for item in obj.values() for t in tensors_in(item)]
    return []


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: T) -> T:
    """``obj`` with every tensor ``t`` inside it replaced by ``fn(t)``; same structure.

    A tensor object held at several places (``(h, h)``, one tensor under two keys) is
    mapped once and the result placed at each: a copy or a move keeps the aliasing, so
    a layer changing one in place changes "both", as in the plain model.
    """
    memo: dict[int, torch.Tensor] = {}  # id(tensor) -> fn(tensor); obj keeps the tensors alive

    def walk(item: object) -> Any:  # a rebuilt container: its type is only known at run time
        if isinstance(item, torch.Tensor):
            if id(item) not in memo:
                memo[id(item)] = fn(item)
            return memo[id(item)]
        if isinstance(item, (tuple, list)):
            return _rebuild_sequence(item, [walk(x) for x in item])
        if isinstance(item, Mapping):
            return _rebuild_mapping(item, {k: walk(v) for k, v in item.items()})
        return item

    result: T = walk(obj)
    return result


def batch_size(batch: object) -> int:
    """The size of dim 0 shared by the tensors of ``batch``.

    Raises MicroBatchTypeError (a ConfigError and TypeError) when ``batch`` holds no
    tensor or a 0-d tensor, ConfigError when first dimensions differ.
    """
    tensors = tensors_in(batch)
    if not tensors:
        raise MicroBatchTypeError(
            f"a pipeline batch must be a tensor, or a tuple, list or dict holding tensors, got "
            f"{type(batch).__name__}: pass the input as a tensor (or a tuple/dict of tensors "
            "split along dim 0)"
        )
    sizes = []
    for t in tensors:
        if t.dim() == 0:
            raise MicroBatchTypeError(
                "a pipeline batch tensor is 0-dimensional and cannot be split into micro-batches: "
                "give every input a batch dimension first (dim 0)"
            )
        sizes.append(int(t.shape[0]))
    if len(set(sizes)) != 1:
        raise ConfigError(
            f"the tensors of a pipeline batch have different batch sizes {sizes} along dim 0: "
            "every tensor in the input tuple must have the same first dimension"
        )
    return sizes[0]


def chunk_sizes(total: int, chunks: int) -> list[int]:
    """The micro-batch sizes ``scatter`` makes for ``total`` rows and ``chunks`` chunks."""
    if chunks < 1:
        raise ConfigError(f"chunks must be a positive integer, got {chunks}: use 1 or more")
    n = min(chunks, total) if total > 0 else 1
    q, r = divmod(total, n)
    return [q + 1 if i < r else q for i in range(n)]


def scatter(batch: T, chunks: int) -> list[T]:
    """Split ``batch`` along dim 0 into ``min(chunks, batch size)`` micro-batches.

    Each micro-batch has the structure of ``batch``. Tensors are views of the input
    (no copy); with one micro-batch it is ``batch`` itself.
    """
    sizes = chunk_sizes(batch_size(batch), chunks)
    if len(sizes) == 1:
        return [batch]
    return [_split(batch, sizes, i) for i in range(len(sizes))]


def _split(obj: T, sizes: list[int], i: int) -> T:
    """Micro-batch ``i`` of ``obj`` (non-tensors unchanged)."""
    start = sum(sizes[:i])
    return map_tensors(lambda t: t[start : start + sizes[i]], obj)  # views, no copy


def _rebuild_sequence(like: Sequence[object], items: list[object]) -> object:
    kind: Callable[..., object] = type(like)
    if hasattr(kind, "_fields"):  # a named tuple takes its fields positionally
        return kind(*items)
    return kind(items)


def _rebuild_mapping(like: Mapping[object, object], values: dict[Any, object]) -> object:
    kind: Callable[..., object] = type(like)
    if kind is dict:
        return values
    # Dataclass-like outputs (transformers' ModelOutput) take their fields as keywords;
    # OrderedDict, UserDict and BatchEncoding-like types take one mapping.
    keywords = dataclasses.is_dataclass(kind) and all(isinstance(k, str) for k in values)
    attempts: list[Callable[[], object]] = [lambda: kind(**values), lambda: kind(values)]
    errors: list[str] = []
    for attempt in attempts if keywords else attempts[::-1]:
        try:
            return attempt()
        except TypeError as exc:
            errors.append(str(exc))
    raise MicroBatchTypeError(
        f"cannot rebuild a {type(like).__name__} from its micro-batch parts ({'; '.join(errors)}): "
        "return or pass a plain dict instead"
    )


def gather(
    outputs: Sequence[object], source: str = "the last layer", rows: Sequence[int] | None = None
) -> object:
    """Concatenate micro-batch outputs along dim 0 (the inverse of ``scatter``).

    Tensors are concatenated, tuples/lists/dicts joined item by item (any depth), and
    a non-tensor value is kept when every micro-batch has the same one. ``source``
    names who made the outputs in the error (e.g. "layer '3' (Tanh) of stage 1").
    Raises MicroBatchTypeError for what cannot be joined (see the module docstring),
    also for a single micro-batch, so a model that fails with M > 1 fails for M = 1.

    ``rows`` (the row count of each micro-batch, as the pipeline passes it) adds the
    checks that the joined value is the one the whole batch would give: every tensor's
    dim 0 must be the same multiple of its micro-batch's rows (``(rows, ...)`` or
    flattened ``(rows * L, ...)``; not ``x.mean(0, keepdim=True)``, a sequence-first
    ``(L, rows, ...)`` or ``x.t()``), and where equal micro-batches leave that in doubt
    the tensor is refused too (:func:`_check_rows`); numbers (int, float, complex) are
    refused, since a count or a mean taken on a micro-batch is not the batch's even when
    all micro-batches agree.
    """
    if not outputs:
        raise ConfigError("gather needs at least one micro-batch output, got none")
    if rows is not None and len(rows) != len(outputs):
        raise ConfigError(
            f"gather got {len(outputs)} micro-batch outputs but {len(rows)} row counts: give one "
            "row count per output"
        )
    first = outputs[0]
    if not tensors_in(first):
        hint = (
            "did its forward() forget a return statement?"
            if first is None
            else "return a tensor (or tensors in a tuple/list/dict), or use split_model, "
            "which passes any value on unchanged"
        )
        raise MicroBatchTypeError(
            f"{source} returned {_describe(first)}, which holds no tensor: {_JOIN_RULE}; {hint}"
        )
    return _join(list(outputs), "the output", source, rows)


def _describe(value: object) -> str:
    if value is None:
        return "None"
    text = repr(value)
    text = text if len(text) <= 40 else text[:37] + "..."
    return f"a {type(value).__name__} ({text})"


_NOT_BATCH_FIX = (
    "the pipeline joins micro-batch outputs along dim 0, which gives the plain model's "
    "output only when dim 0 holds the rows (or a fixed multiple of them, e.g. flattened "
    "tokens); put the batch first (e.g. batch_first=True, .transpose(0, 1)), reduce over "
    "the batch outside the pipeline, or use split_model, which returns any output unchanged"
)


def _check_rows(parts: list[torch.Tensor], rows: Sequence[int], path: str, source: str) -> None:
    """Refuse tensors the pipeline cannot tell to be batch-major (rows along dim 0).

    What is decidable from shapes:

    - dim 0 must be one multiple ``k >= 1`` of each micro-batch's row count, for every
      micro-batch (``(rows, ...)``, or flattened ``(rows * L, ...)``). Micro-batches of
      different sizes settle the question: a sequence-first ``(L, rows, ...)``, a
      transposed ``(F, rows)``, a ``mean(0, keepdim=True)`` fail it.
    - The other dims must agree between micro-batches (a ``(rows, rows)`` matrix of pairs
      within a micro-batch tracks the rows there, and joins into the wrong thing).
    - When every micro-batch has the same ``n`` rows (M > 1), shapes cannot tell dim 0
      from a dim that merely has ``n`` (or ``k * n``) entries. Then a layout that puts
      the batch after dim 0 is refused as in doubt, with both fixes: dim 0 a multiple
      ``k > 1`` of ``n`` and a later dim of exactly ``n`` (sequence-first ``(k * n, n,
      ...)``, ``x.t()`` of ``(n, k * n)``), or -- three or more dims -- dim 1 of ``n``
      entries (time-major ``(L, n, ...)`` with ``L == n``: nn.LSTM, nn.GRU and
      nn.Transformer without ``batch_first``). What stays undecidable is accepted as
      batch-first: a 2-D ``(n, n)`` (``n`` classes, or ``x.t()`` of ``(n, n)``), image
      sides equal to ``n``. A single micro-batch is returned as is: nothing to doubt.
    """
    pairs = list(zip(parts, rows, strict=True))
    factors = {p.shape[0] // n if p.shape[0] % n == 0 else -1 for p, n in pairs if n}
    shapes = ", ".join(f"{tuple(p.shape)} for {n} rows" for p, n in pairs[:4])
    if factors and (len(factors) > 1 or -1 in factors or 0 in factors):
        raise MicroBatchTypeError(
            f"{source} returned tensors at {path} whose dim 0 is not the batch ({shapes}): "
            + _NOT_BATCH_FIX)
    if len({tuple(p.shape[1:]) for p in parts}) > 1:
        raise MicroBatchTypeError(
            f"{source} returned tensors at {path} whose later dims differ between "
            f"micro-batches ({shapes}), so they cannot be joined: a dim that follows the rows "
            "of each micro-batch (e.g. pairs within the batch) is not the batch's; "
            + _NOT_BATCH_FIX)
    if len(parts) < 2 or len(set(rows)) != 1 or not factors:
        return
    n, (k,) = rows[0], factors
    shape = parts[0].shape
    later = [j for j in range(1, len(shape)) if shape[j] == n]
    dims = later if k > 1 else [1] if n > 1 and len(shape) >= 3 and shape[1] == n else []
    if dims:
        raise MicroBatchTypeError(
            f"{source} returned tensors at {path} of shape {tuple(parts[0].shape)} for "
            f"micro-batches of {n} rows each: dim {dims[0]} has {n} entries, as many as the "
            f"rows, so the batch may lie along dim {dims[0]} instead of dim 0 (sequence-first, "
            "x.t(), pairs within the micro-batch), and joining along dim 0 would then differ "
            "from the plain model's output. If dim 0 is not the batch: "
            + _NOT_BATCH_FIX + f". If dim 0 is the batch and dim {dims[0]} only happens to have "
            f"{n} entries, choose chunks (or the batch size) so the micro-batches have another "
            "size")


def _join(
    parts: list[object], path: str, source: str, rows: Sequence[int] | None = None
) -> object:
    first = parts[0]
    if any(type(p) is not type(first) for p in parts):
        kinds = sorted({type(p).__name__ for p in parts})
        raise MicroBatchTypeError(
            f"{source} returned different types for different micro-batches at {path} "
            f"({', '.join(kinds)}): {_JOIN_RULE}; return the same structure for every input"
        )
    if isinstance(first, torch.Tensor):
        tensors = [p for p in parts if isinstance(p, torch.Tensor)]  # all of them (same type)
        if any(p.dim() == 0 for p in tensors):
            raise MicroBatchTypeError(
                f"{source} returned a 0-dimensional tensor at {path} (e.g. a loss or a sum over "
                f"the batch), which has no batch dimension: {_JOIN_RULE}; return per-sample values "
                "and reduce them outside the pipeline, e.g. loss_fn(pipe(x), y)"
            )
        if rows is not None:
            _check_rows(tensors, rows, path, source)
        return torch.cat(tensors, dim=0)
    if isinstance(first, (tuple, list)):
        sequences = [p for p in parts if isinstance(p, (tuple, list))]
        if len({len(p) for p in sequences}) != 1:
            raise MicroBatchTypeError(
                f"{source} returned {type(first).__name__}s of different lengths at {path}: "
                f"{_JOIN_RULE}; return the same structure for every input"
            )
        items = [
            _join([p[k] for p in sequences], f"{path}[{k}]", source, rows)
            for k in range(len(first))
        ]
        return _rebuild_sequence(first, items)
    if isinstance(first, Mapping):
        keys = list(first)
        mappings = [p for p in parts if isinstance(p, Mapping)]
        if any(list(p) != keys for p in mappings):
            raise MicroBatchTypeError(
                f"{source} returned dicts with different keys at {path}: {_JOIN_RULE}; return "
                "the same keys for every input"
            )
        joined = {
            k: _join([p[k] for p in mappings], f"{path}[{k!r}]", source, rows) for k in keys
        }
        return _rebuild_mapping(first, joined)
    number = isinstance(first, (int, float, complex)) and not isinstance(first, bool)
    if rows is not None and number:
        raise MicroBatchTypeError(
            f"{source} returned {_describe(first)} at {path}: a number may depend on the rows "
            "it was computed from (a count, a mean), and the pipeline only sees each "
            f"micro-batch's, not the batch's: {_JOIN_RULE}; return it as a tensor with one row "
            "per sample, compute it outside the pipeline, or use split_model"
        )
    if first is None or isinstance(first, _PLAIN):
        if all(p == first for p in parts[1:]):
            return first
        raise MicroBatchTypeError(
            f"{source} returned {_describe(first)} at {path} and a different value for another "
            f"micro-batch: {_JOIN_RULE}; return it as a tensor with one row per sample, or use "
            "chunks=1"
        )
    raise MicroBatchTypeError(
        f"{source} returned {_describe(first)} at {path}, a type the pipeline cannot join: "
        f"{_JOIN_RULE}; return tensors, or use split_model, which passes any value on unchanged"
    )
