"""Collate functions: how a list of dataset items becomes one batch.

Without one, torch's ``default_collate`` stacks the items, which needs every tensor of
every item to have the same shape. Token sequences of different lengths (what a tokenizer
returns without ``padding="max_length"``) need a collate function that pads them, such
as Hugging Face's ``DataCollatorWithPadding(tokenizer)``: ``fit(..., collate_fn=fn)`` or
``torchgpu train --collate-fn SPEC``.

- :func:`resolve_collate`: the function a ``--collate-fn`` spec names: the collate
  function itself (a callable taking the list of items), or a zero-argument factory
  (a function, or a class whose constructor needs no argument) returning one.
- :class:`Collate`: the function the loaders, the probe and the batch-size search call;
  a failure becomes one paragraph naming the collate function (or, without one, the
  shapes that differ and the fix) instead of torch's traceback.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor

from torchgpu.errors import DataError, TorchGpuError, UsageError, first_line

CollateFn = Callable[[list[Any]], Any]
#: How the fix is named in messages: both ways to pass a collate function.
FIX = "--collate-fn SPEC (torchgpu train) or collate_fn= (fit)"


def _own_paragraph(message: str, kind: type) -> str:
    """``message`` as raised: a DataLoader worker's failure comes back as
    ``kind("Caught ... Original Traceback ... module.Kind: paragraph")``; keep the
    paragraph (the run's error is one paragraph, not the worker's traceback)."""
    marker = f"{kind.__module__}.{kind.__qualname__}: "
    if "Original Traceback" in message and marker in message:
        return message.rsplit(marker, 1)[1].strip()
    return message


class ItemsDoNotStack(DataError):
    """Items that torch's default collate cannot batch (one paragraph, from a
    DataLoader worker too)."""

    def __init__(self, message: str) -> None:
        super().__init__(_own_paragraph(message, ItemsDoNotStack))


class CollateFailed(UsageError):
    """The user's collate function failed (one paragraph, from a DataLoader worker too)."""

    def __init__(self, message: str) -> None:
        super().__init__(_own_paragraph(message, CollateFailed))


def _required_args(fn: object) -> int | None:
    """Positional parameters ``fn`` needs (None when its signature cannot be read)."""
    try:
        signature = inspect.signature(fn)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in signature.parameters.values()
               if p.kind in kinds and p.default is inspect.Parameter.empty)


def resolve_collate(spec: str) -> CollateFn:
    """The collate function ``spec`` (``module.path:attr`` or ``file.py:attr``) names.

    ``attr`` is the collate function itself (it takes one argument, the list of items)
    or a factory called once with no argument that returns it (a function, or a class
    with no required constructor argument, e.g. a collator class with defaults). A
    factory is how a collator needing a tokenizer is given: ``def collate(): return
    DataCollatorWithPadding(tokenizer)``. UsageError (exit 2) for a spec that does not
    resolve, a class that needs arguments, a factory that fails or returns no callable.
    """
    from torchgpu.factories import resolve_spec

    value = resolve_spec(spec, "collate-fn")
    if not callable(value):
        raise UsageError(
            f"--collate-fn {spec}: {spec.rpartition(':')[2]} is a {type(value).__name__}, "
            "not callable: name a collate function fn(items) -> batch, or a zero-argument "
            "factory returning one.")
    needed = _required_args(value)
    if isinstance(value, type):
        if needed:
            raise UsageError(
                f"--collate-fn {spec}: the class {value.__name__} needs constructor "
                "arguments (e.g. a tokenizer): name a zero-argument function that builds "
                f"the collator instead, e.g. def collate(): return {value.__name__}(...)")
        needed = 0
    if needed != 0:  # the collate function itself
        fn: CollateFn = value
        return fn
    try:
        built = value()
    except TorchGpuError:
        raise
    except Exception as error:
        raise UsageError(
            f"--collate-fn {spec}: the factory failed ({first_line(error)}); fix it, or "
            "name the collate function itself (fn(items) -> batch).") from None
    if not callable(built):
        raise UsageError(
            f"--collate-fn {spec}: the factory returned a {type(built).__name__}, not a "
            "collate function: return a callable fn(items) -> batch.")
    made: CollateFn = built
    return made


def _leaf_shapes(item: object, path: str = "") -> dict[str, tuple[int, ...] | str]:
    """Every leaf of ``item`` by its path (``input_ids``, ``0``, ``0.pixels``): a
    tensor's (or array's) shape, a list's length, or the leaf's type."""
    if isinstance(item, Tensor) or hasattr(item, "shape"):
        return {path or "the item": tuple(int(n) for n in getattr(item, "shape", ()))}
    if isinstance(item, Mapping):
        return {k: v for key, value in item.items()
                for k, v in _leaf_shapes(value, f"{path}.{key}" if path else str(key)).items()}
    if isinstance(item, Sequence) and not isinstance(item, str | bytes):
        if item and all(isinstance(v, int | float | bool) for v in item):
            return {path or "the item": (len(item),)}
        return {k: v for i, value in enumerate(item)
                for k, v in _leaf_shapes(value, f"{path}.{i}" if path else str(i)).items()}
    return {path or "the item": type(item).__name__}


def _shape_text(shape: tuple[int, ...] | str) -> str:
    if isinstance(shape, str):
        return f"a {shape}"
    return "(" + ", ".join(str(n) for n in shape) + ("," if len(shape) == 1 else "") + ")"


def differing_shapes(items: Sequence[object]) -> str | None:
    """``item 0 has input_ids of shape (7,), item 1 (12,)``: the first leaf whose shape
    differs between item 0 and a later item, or None when every shape agrees."""
    if len(items) < 2:
        return None
    first = _leaf_shapes(items[0])
    for index, other in enumerate(items[1:], start=1):
        shapes = _leaf_shapes(other)
        for name, shape in first.items():
            if name in shapes and shapes[name] != shape:
                return (f"item 0 has {name} of shape {_shape_text(shape)}, item {index} "
                        f"{_shape_text(shapes[name])}")
    return None


class Collate:
    """``fn`` (default ``default_collate``) with its failures in one paragraph.

    ``label`` names the function in messages (``--collate-fn mod:fn``, ``collate_fn=``).
    Without ``fn``, items that do not stack raise :class:`DataError` naming the shapes
    that differ and the fix (:data:`FIX`); a given ``fn`` that raises is
    :class:`UsageError` naming ``label``. Picklable when ``fn`` is (DataLoader workers).
    """

    def __init__(self, fn: CollateFn | None = None, label: str = "") -> None:
        self.fn = fn
        self.label = label or ("the collate function "
                               + getattr(fn, "__name__", type(fn).__name__))

    def __call__(self, items: list[Any]) -> Any:
        if self.fn is not None:
            try:
                return self.fn(items)
            except TorchGpuError:
                raise
            except Exception as error:
                raise CollateFailed(
                    f"{self.label} failed on a batch of {len(items)} items "
                    f"({first_line(error)}): the collate function must turn a list of "
                    "dataset items into one batch (a dict of tensors, or an (inputs, "
                    "target) pair); fix it, or check that it fits the dataset's items."
                ) from None
        from torch.utils.data import default_collate

        try:
            return default_collate(items)
        except Exception as error:
            differ = differing_shapes(items)
            if differ is None:
                raise ItemsDoNotStack(
                    f"{len(items)} items of the data do not form a batch "
                    f"({first_line(error)}): items must be (inputs, target) pairs or dicts "
                    "of tensors that torch's default collate can stack; for anything else "
                    f"pass a collate function: {FIX}."
                ) from None
            raise ItemsDoNotStack(
                f"{len(items)} items of the data do not stack into one batch: {differ}. "
                "Items of different lengths (token sequences a tokenizer returned without "
                "padding='max_length') need a collate function that pads them, e.g. "
                f"transformers' DataCollatorWithPadding(tokenizer): pass {FIX}, or pad "
                "every item to one length in the dataset."
            ) from None
