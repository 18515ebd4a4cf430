"""Batches of any structure: the engine's one convention for the user's data.

Every batch reaches the training loop as a pair ``(inputs, target)``:

- a dataset of ``(inputs, target)`` items collates (``default_collate``) to
  ``[inputs, target]``; ``inputs`` may be a tensor, a tuple/list of tensors or a dict;
- a dataset of dicts collates to one dict ``batch``; :class:`DictPairs` hands it to the
  loop as ``(batch, batch)``, so the model gets the whole dict (labels included, which is
  how a language model computes its own ``.loss``) and the loss gets the batch.

The model is called by the convention of :func:`install_call_convention`: a tensor as
``model(x)``, a tuple/list as ``model(*inputs)``, a dict as ``model(**inputs)``.

The number of samples in a batch (for exact accumulation, DDP weighting, throughput) is
the first dimension of its first tensor (:func:`batch_rows`). When a model returns a
*mean over tokens* (a language model's ``.loss``), torchgpu weights micro-batches by
samples, not tokens: exact when every sample has the same number of counted tokens, an
approximation (the same one DDP makes) when padding varies between micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from torchgpu.errors import DataError


def _leaves(obj: object) -> list[Tensor]:
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in _leaves(v)]
    if isinstance(obj, Sequence) and not isinstance(obj, str | bytes):
        return [t for v in obj for t in _leaves(v)]
    return []


def _rebuild(obj: object, fn: Callable[[Tensor], Tensor]) -> object:
    """``obj`` with ``fn`` applied to every tensor that has a batch dimension."""
    if isinstance(obj, Tensor):
        return fn(obj) if obj.dim() else obj
    if isinstance(obj, Mapping):
        return {k: _rebuild(v, fn) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        namedtuple_type: Callable[..., object] = type(obj)
        return namedtuple_type(*(_rebuild(v, fn) for v in obj))
    if isinstance(obj, Sequence) and not isinstance(obj, str | bytes):
        return type(obj)(_rebuild(v, fn) for v in obj) if isinstance(obj, tuple) else [
            _rebuild(v, fn) for v in obj]
    return obj


def _numbers_only(value: list[Any]) -> tuple[int, str] | None:
    """``(length, element type)`` when ``value`` is a (nested) list of Python numbers."""
    if not value:
        return None
    flat: list[Any] = []
    pending: list[Any] = [value]
    while pending:
        current = pending.pop()
        for v in current:
            (pending if isinstance(v, list) else flat).append(v)
    if flat and all(isinstance(v, int | float | bool) for v in flat):
        return len(value), type(flat[0]).__name__
    return None


def check_dict_item(item: object, what: str) -> None:
    """Refuse a dict item holding Python lists of numbers (a tokenizer's
    ``{"input_ids": [...]}`` without ``return_tensors``): ``default_collate`` would batch
    such a list position by position (a list of per-token tensors), which no model's
    forward takes. Raises :class:`DataError` naming the key and the fix."""
    if not isinstance(item, Mapping):
        return
    for key, value in item.items():
        found = _numbers_only(value) if isinstance(value, list) else None
        if found is None:
            continue
        length, kind = found
        raise DataError(
            f"{what}: item 0's {key!r} is a Python list of {length} {kind}s, not a tensor; "
            "torch's default collate would batch it position by position (a list of "
            f"{length} tensors), which no model takes as {key}. Return tensors from "
            f"__getitem__ (torch.tensor(item[{key!r}]); a tokenizer called with "
            "return_tensors='pt' gives them), every item padded to the same length (a "
            "tokenizer's padding='max_length'), or pass a collate function that pads the "
            "items (e.g. transformers' DataCollatorWithPadding(tokenizer)): --collate-fn "
            "SPEC (torchgpu train) or collate_fn= (fit)."
        )


def batch_rows(obj: object) -> int:
    """Samples in ``obj``: the first dimension of its first tensor with one.

    Raises :class:`DataError` when ``obj`` holds no batched tensor.
    """
    for t in _leaves(obj):
        if t.dim():
            return int(t.shape[0])
    raise DataError(
        f"a batch of type {type(obj).__name__} holds no tensor with a batch dimension: the "
        "engine takes (inputs, target) pairs or dicts of tensors; have the dataset return "
        "tensors (torch.as_tensor) or pass a collate function that does"
    )


def split_rows(obj: object, count: int) -> list[Any]:  # pieces of a batch of any structure
    """``obj`` cut into ``count`` consecutive pieces along the batch dimension
    (``Tensor.tensor_split`` on every batched tensor; other leaves are shared)."""
    if count <= 1:
        return [obj]
    def piece(i: int) -> Callable[[Tensor], Tensor]:
        return lambda t: t.tensor_split(count)[i]

    return [_rebuild(obj, piece(i)) for i in range(count)]


def take_rows(obj: object, index: Tensor) -> object:
    """The rows ``index`` of every batched tensor in ``obj`` (cyclic samples for probes)."""
    return _rebuild(obj, lambda t: t[index % t.shape[0]])


def first_rows(obj: object, n: int) -> object:
    """The first ``n`` rows of every batched tensor in ``obj``."""
    return _rebuild(obj, lambda t: t[:n])


class DictPairs:
    """A collate function for datasets of dicts: ``(batch, batch)`` from ``inner``'s
    collated dict (default ``default_collate``)."""

    def __init__(self, inner: Callable[[list[Any]], Any] | None = None) -> None:
        from torch.utils.data import default_collate

        self.inner = inner or default_collate

    def __call__(self, items: list[Any]) -> tuple[object, object]:
        batch = self.inner(items)
        return batch, batch


def _spread(module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]
            ) -> tuple[tuple[object, ...], dict[str, object]] | None:
    if len(args) != 1 or kwargs:
        return None
    (only,) = args
    if isinstance(only, Mapping):
        return (), dict(only)
    if isinstance(only, tuple | list) and not hasattr(only, "_fields"):
        return tuple(only), {}
    return None


def install_call_convention(model: nn.Module) -> RemovableHandle:
    """Make ``model(batch)`` mean ``model(**batch)`` for a dict and ``model(*inputs)`` for
    a tuple/list, for the duration of a run (remove the returned handle afterwards).

    A forward pre-hook on the model itself, not a wrapper module, so state-dict keys stay
    canonical and DDP, DataParallel and FSDP (which call the inner module with the batch
    they scattered) need no change.
    """
    # prepend: the user's own pre-hooks then see the call exactly as model(**batch) makes it
    return model.register_forward_pre_hook(_spread, with_kwargs=True, prepend=True)


def output_loss(output: object, batch: object) -> Tensor:
    """The loss a model computed itself: ``output.loss``, ``output["loss"]`` or a scalar
    output. Raises :class:`DataError` naming the output's type otherwise."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None and isinstance(output, Tensor) and output.dim() == 0:
        loss = output
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        kind = type(output).__name__
        raise DataError(
            f"the model returned a {kind} with no scalar loss (no .loss, no ['loss'], not a "
            "scalar tensor) and no loss function was given: pass loss= to fit / --loss to "
            "torchgpu train (mse, cross_entropy or module:function), or make the model "
            "compute its loss when the batch holds labels"
        )
    return loss


def is_empty(obj: object) -> bool:
    """True for a batch with zero rows (a DDP rank's empty share of the last batch)."""
    try:
        return batch_rows(obj) == 0
    except DataError:
        return False


def _output_tensors(output: object) -> list[Tensor]:
    if isinstance(output, Tensor | Mapping | Sequence):
        return _leaves(output)
    return _leaves(dict(getattr(output, "__dict__", {})))  # a dataclass-style output


def zero_loss_like(output: object) -> Tensor | None:
    """A loss of exactly zero connected to the parameters the forward used: the sum of the
    output's batched float tensors times zero (scalars such as a mean loss over no rows,
    which is NaN, are left out). None when the output holds no such tensor."""
    total: Tensor | None = None
    for t in _output_tensors(output):
        if t.is_floating_point() and t.dim():
            term = t.float().sum() * 0.0
            total = term if total is None else total + term
    return total
