"""Task: what the engine trains on what -- the one plug-in shape.

A :class:`Task` bundles a model factory, the training and evaluation datasets, the loss,
the evaluation metrics, the default optimizer and the evaluation batch size. Built-in
examples, ``--model/--data`` specs and ``torchgpu.fit`` (:func:`user_task`) all produce one,
and nothing in the engine asks which kind it runs. Batches are ``(inputs, target)`` pairs or
dicts (``model(**batch)``; without a loss, the model's ``output.loss``, ``output["loss"]``
or scalar output is the loss; a given loss is called ``loss(output, batch)``). Metrics are
``{name: metric}``: ``fn(output, target_or_batch) -> float``, averaged over the evaluation
samples, or an object with ``reset``/``update``/``compute`` (torchmetrics-style).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sized
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from torchgpu.data.base import ExampleData
from torchgpu.data.batches import DictPairs, check_dict_item, output_loss
from torchgpu.data.collate import Collate, CollateFn
from torchgpu.errors import DataError, UsageError
from torchgpu.train.metrics import MetricLike, check_metrics
from torchgpu.train.recipe import optimizers
from torchgpu.train.recipe.optimizers import OptimizerChoice

LossFn = Callable[[Any, Any], Tensor]
LOSS_NAMES: tuple[str, ...] = ("mse", "cross_entropy")


@dataclass(frozen=True)
class Task:
    """A model factory, data, loss, metrics, default optimizer and evaluation batch.

    Frozen. ``name``, ``build_model``, ``train``, ``test`` and ``loss`` are required; the
    comments at the optional fields say what each changes."""

    name: str
    build_model: Callable[[], nn.Module]
    train: Dataset[Any]
    test: Dataset[Any] | None
    loss: LossFn
    metrics: Mapping[str, MetricLike] = field(default_factory=dict)  # reported as test_<name>
    # The run's optimizer unless --optimizer names another: a built-in name at --lr or a
    # function params -> Optimizer; AdamW for a user's model, Adam for the built-in examples
    # (as their seeds).
    optimizer: OptimizerChoice = "adamw"
    scheduler: Callable[[Any], Any] | None = None  # optimizer -> LRScheduler; None: --lr-schedule
    # The held-out batch is at least this many rows (evaluation keeps no activations for
    # backward, so it takes larger batches); None: the training batch size.
    eval_batch_size: int | None = None
    dict_batches: bool = False  # the datasets yield dicts (collated by DictPairs)
    # The in-memory tensors of a built-in example or CSV table, which the planner and the
    # model/pipeline strategies measure on (a launcher hands a CSV's to its workers).
    example: ExampleData | None = None
    # The plug-in vouches that its model takes its data and loss, so the two-sample probe
    # before --out exists is skipped (for ResNet-50 it costs a forward).
    trusted: bool = False
    kind: str = "custom"  # summary.json's task label; nothing in the engine depends on it
    description: str = ""
    # Turns a list of items into a batch wherever batches are made (loaders, probe, batch
    # size search, planner); None: torch's default_collate. collate_label names it in
    # messages (--collate-fn SPEC or collate_fn=).
    collate_fn: Callable[[list[Any]], Any] | None = None
    collate_label: str = "collate_fn="

    def make_optimizer(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        """The run's optimizer (:attr:`optimizer`) over ``model``'s trainable parameters,
        at ``lr`` for a built-in name. UsageError when there are none, or a factory fails
        or returns no Optimizer."""
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:  # torch's "optimizer got an empty parameter list", with the fix
            raise untrainable("the model", model)
        return optimizers.make(self.optimizer, params, lr)

    @property
    def train_rows(self) -> int:
        """Samples in the training split (a map-style Dataset has ``len()``; a stream
        without one counts as unbounded, ``sys.maxsize``)."""
        from torchgpu.data.stream import stream_length

        if isinstance(self.train, IterableDataset):
            length = stream_length(self.train)
            return sys.maxsize if length is None else length
        assert isinstance(self.train, Sized)  # a map-style Dataset (check_dataset)
        return len(self.train)

    def eval_batch(self, batch_size: int) -> int:
        """The held-out split's batch size when training takes ``batch_size`` rows."""
        return max(batch_size, self.eval_batch_size or 0)

    @property
    def collate_items(self) -> Collate | None:
        """The function that makes a batch of items for the loaders: the user's
        ``collate_fn`` with its failures in one paragraph (None without one: the loader's
        default)."""
        return Collate(self.collate_fn, self.collate_label) if self.collate_fn else None

    @property
    def collate(self) -> Callable[[list[Any]], Any]:
        """The DataLoader's collate function: :attr:`collate_items` (default
        ``default_collate``), whose failures are one paragraph; dict batches as
        ``(batch, batch)`` (:class:`DictPairs`)."""
        inner = Collate(self.collate_fn, self.collate_label)
        return DictPairs(inner) if self.dict_batches else inner

    def sample(self, rows: int, split: str = "train") -> tuple[Any, Any]:
        """The first ``rows`` samples of ``split`` (``train``, or ``test``: the held-out
        split, which must exist) as one ``(inputs, target)`` batch (cycling when the
        dataset is smaller), collated as the loaders do: probes, measurements, the
        planner. DataError (default collate: the shapes that differ) or UsageError
        (``collate_fn``) when the items do not form a batch."""
        from torch.utils.data import TensorDataset

        dataset = self.train if split == "train" else self.test
        if isinstance(dataset, IterableDataset):  # a fresh pass: training's untouched
            from torchgpu.data.stream import first_items

            head = first_items(dataset, max(1, rows))
            return self._collated([head[i % len(head)] for i in range(max(1, rows))])
        assert isinstance(dataset, Sized)  # a map-style Dataset (check_dataset)
        n = len(dataset)
        if (self.collate_fn is None and isinstance(dataset, TensorDataset)
                and len(dataset.tensors) == 2):
            index = torch.arange(max(1, rows)) % n
            return dataset.tensors[0][index], dataset.tensors[1][index]
        return self._collated([dataset[i % n] for i in range(max(1, rows))])

    def _collated(self, items: list[Any]) -> tuple[Any, Any]:
        """``items`` made one batch as the loaders make it (:attr:`collate`)."""
        batch = self.collate(items)
        if not self.dict_batches:
            check_pair(batch, self.collate_label if self.collate_fn else "")
        inputs, target = batch
        return inputs, target


def loss_by_name(name: str) -> LossFn:
    """``mse`` (float targets reshaped to the output) or ``cross_entropy``."""
    if name == "mse":
        mse = nn.MSELoss()
        return lambda out, y: mse(out, y.reshape(out.shape).to(out.dtype))
    if name == "cross_entropy":
        return nn.CrossEntropyLoss()
    raise UsageError(
        f"--loss {name}: not a built-in loss ({', '.join(LOSS_NAMES)}) and not a "
        "module:function spec; pass one of those, e.g. --loss cross_entropy or "
        "--loss mypkg.losses:my_loss"
    )


def _first_items(dataset: Dataset[Any], what: str) -> list[Any]:
    """The first two items of ``dataset`` (one when it has one), a stream's from a pass
    of their own."""
    if isinstance(dataset, IterableDataset):
        from torchgpu.data.stream import first_items

        head = first_items(dataset, 2)
        if not head:
            raise DataError(f"{what} is a stream that yields no items: there is nothing "
                            "to train on; check the data source")
        return head
    try:
        assert isinstance(dataset, Sized)
        return [dataset[0], dataset[1]] if len(dataset) > 1 else [dataset[0]]
    except Exception as error:
        raise DataError(
            f"{what}: reading its first item failed ({type(error).__name__}: {error}); a "
            "map-style Dataset must return a sample for index 0"
        ) from None


def _is_dict_dataset(dataset: Dataset[Any], what: str,
                     collate: CollateFn | None = None, label: str = "") -> bool:
    """Whether ``dataset``'s batches are dicts (else ``(inputs, target)`` pairs). With a
    collate function, what it makes of the first two items decides (tokenizer-style items
    of Python lists are its to pad); without one, the first item."""
    items = _first_items(dataset, what)
    item = items[0]
    if collate is not None:
        batch = Collate(collate, label)(items)
        if isinstance(batch, Mapping):
            return True
        check_pair(batch, label)
        return False
    if isinstance(item, Mapping):
        check_dict_item(item, what)  # tokenizer-style Python lists: refused with the fix
        return True
    if isinstance(item, tuple | list) and len(item) == 2:
        return False
    raise DataError(
        f"{what} returns items of type {type(item).__name__}: the engine takes "
        "(inputs, target) pairs or dicts of tensors; return one of those from "
        f"{'__iter__' if isinstance(dataset, IterableDataset) else '__getitem__'}, "
        "or pass a collate function that makes a batch of such from the items"
    )


def check_pair(batch: object, label: str) -> None:
    """UsageError naming the collate function ``label`` when ``batch`` is neither a
    dict nor an ``(inputs, target)`` pair (the two shapes the engine trains on)."""
    if isinstance(batch, tuple | list) and len(batch) == 2 and not hasattr(batch, "_fields"):
        return
    # A callable batch is a collator: a one-argument factory (`def collate(tokenizer)`)
    # was taken for the collate function itself and called with the items.
    hint = (" (a function: a factory taking an argument is called as the collate function, "
            "with the list of items; name the collate function itself or a zero-argument "
            "factory returning it)" if callable(batch) else "")
    raise UsageError(
        f"{label or 'the collate function'} returned a {type(batch).__name__}"
        f"{f' of {len(batch)} elements' if isinstance(batch, tuple | list) else ''}{hint}, "
        "which the model cannot take: a collate function must return a dict of tensors "
        "(model(**batch), e.g. input_ids, attention_mask, labels) or an (inputs, target) "
        "pair; fix what it returns."
    )


def check_dataset(dataset: Any, what: str, *, shuffled: bool = False,
                  stream: bool = False) -> Dataset[Any]:
    """``dataset`` if it is a non-empty map-style Dataset or a stream (an
    ``IterableDataset``, where ``stream`` allows one: :mod:`torchgpu.data.stream`), else
    DataError with the fix. ``shuffled`` (the training split): a map-style length whose
    epoch order would not fit in memory is refused too
    (:func:`~torchgpu.data.loader.check_order_fits`).
    """
    if isinstance(dataset, IterableDataset):
        if not stream:
            raise DataError(
                f"{what} is an IterableDataset ({type(dataset).__name__}): evaluation "
                "reads a map-style dataset (len() and indexing); streams are for the "
                "training data. Materialise the held-out split into a list or a "
                "TensorDataset."
            )
        checked_stream: Dataset[Any] = dataset
        return checked_stream
    if isinstance(dataset, nn.Module):
        raise DataError(
            f"{what} is a model ({type(dataset).__name__}), not a Dataset: the data spec "
            "must return a Dataset or a (train, eval) pair; the model goes to --model."
        )
    if isinstance(dataset, DataLoader):  # the engine makes the loaders (shards, resume)
        raise DataError(
            f"{what} is a DataLoader: torchgpu builds the loaders itself (DDP shards, exact "
            "resume, the batch-size search); pass its dataset (loader.dataset) instead, "
            "its collate function as collate_fn= (fit) or --collate-fn SPEC (torchgpu "
            "train), and its batch size as batch_size= / --batch-size."
        )
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise DataError(
            f"{what} is a {type(dataset).__name__}, not a Dataset: pass a map-style "
            "torch.utils.data.Dataset (with __len__ and __getitem__), or a (train, eval) "
            "pair of them."
        )
    try:
        size = len(dataset)
    except Exception as error:  # the user's __len__: any failure is theirs to fix
        raise DataError(
            f"{what}: len() failed ({type(error).__name__}: {error}); a map-style Dataset "
            "must return its number of samples from __len__"
        ) from None
    if size == 0:
        raise DataError(f"{what} is empty: there is nothing to train on; check the data")
    if shuffled:
        from torchgpu.data.loader import check_order_fits

        check_order_fits(size, what)
    checked: Dataset[Any] = dataset
    return checked


def user_task(build_model: Callable[[], nn.Module], train: Any, test: Any = None,
              loss: LossFn | None = None, metrics: Mapping[str, Any] | None = None,
              name: str = "model", collate_fn: CollateFn | None = None,
              collate_label: str = "collate_fn=") -> Task:
    """A Task for a user's model and datasets (``fit`` and ``--model/--data``): AdamW
    by default, evaluation in training-sized batches. ``collate_fn`` makes the batches
    of both datasets (``collate_label`` names it in messages).

    Raises DataError for data the engine cannot take (not a map-style Dataset, items that
    are neither pairs nor dicts, train and eval of different shapes), UsageError for pairs
    without a loss or a malformed metric.
    """
    checked = check_metrics(metrics)
    train = check_dataset(train, "the training data", shuffled=True, stream=True)
    if collate_fn is not None and not callable(collate_fn):
        raise UsageError(
            f"{collate_label} is a {type(collate_fn).__name__}, not a function: pass a "
            "collate function fn(items) -> batch (e.g. DataCollatorWithPadding(tokenizer))")
    dict_batches = _is_dict_dataset(train, "the training data", collate_fn, collate_label)
    if test is not None:
        test = check_dataset(test, "the evaluation data")
        if _is_dict_dataset(test, "the evaluation data", collate_fn,
                            collate_label) != dict_batches:
            raise DataError(
                "the training data yields "
                f"{'dicts' if dict_batches else 'pairs'} but the evaluation data does not: "
                "give both datasets the same item structure"
            )
    if loss is None:
        if not dict_batches:
            raise UsageError(
                "the data yields (inputs, target) pairs but no loss was given: pass loss= to "
                "fit (e.g. torch.nn.CrossEntropyLoss()) or --loss mse|cross_entropy|"
                "module:function to torchgpu train; a model that computes its own loss "
                "takes dict batches (model(**batch) -> output.loss)."
            )
        loss = output_loss
    return Task(name=name, build_model=build_model, train=train, test=test, loss=loss,
                metrics=checked, dict_batches=dict_batches, collate_fn=collate_fn,
                collate_label=collate_label)


def as_factory(model: nn.Module | Callable[[], nn.Module], what: str = "model"
               ) -> Callable[[], nn.Module]:
    """A zero-argument factory for ``model`` (a module is returned as it is, once built)."""
    if isinstance(model, nn.Module):
        return lambda: model
    if callable(model):
        def build() -> nn.Module:
            built = model()
            if not isinstance(built, nn.Module):
                raise UsageError(
                    f"the {what} factory returned a {type(built).__name__}, not an nn.Module: "
                    "return the model from the factory (or pass the module itself)"
                    + ("; blocks go in an nn.ModuleList or nn.Sequential, not a Python list"
                       if isinstance(built, list | tuple) else "")
                )
            return built

        return build
    raise UsageError(
        f"{what} is a {type(model).__name__}: pass an nn.Module or a zero-argument function "
        "that builds one"
    )


def seeded(factory: Callable[[], nn.Module], seed: int) -> Callable[[], nn.Module]:
    """``factory`` run under ``torch.manual_seed(seed)``: the same weights on every rank."""
    def build() -> nn.Module:
        torch.manual_seed(seed)
        return factory()

    return build


def untrainable(label: str, model: nn.Module) -> UsageError:
    """The error for a model (``label``) none of whose parameters requires a gradient."""
    count = sum(1 for _ in model.parameters())
    which = (f"its {count} parameters are all frozen (requires_grad=False)" if count
             else f"it is a {type(model).__name__} without parameters")
    return UsageError(
        f"{label} has no trainable parameters ({which}): the optimizer would have nothing "
        "to update. Unfreeze what should train (p.requires_grad_(True)), or pass a model "
        "that has parameters."
    )


def spreads_inputs(task: Task) -> bool:
    """True when the model must be called ``model(**batch)`` / ``model(*inputs)``: dict
    batches, or pairs whose inputs are a tuple/list/dict (plain tensors need nothing)."""
    if task.dict_batches:
        return True
    inputs, _ = task.sample(1)
    return isinstance(inputs, tuple | list | Mapping)
