"""Task: what the engine trains on what — the one plug-in shape.

A :class:`Task` bundles a model factory, the training and evaluation datasets, the loss,
the evaluation metrics, the default optimizer and the evaluation batch size. The built-in
examples and CSV tables (the plug-ins of :mod:`torchgpu.examples`), ``--model SPEC
--data SPEC`` (:func:`torchgpu.train.plugin.task_for_config`) and :func:`torchgpu.fit`
(:func:`user_task`) all produce one, and the engine treats them alike: nothing in it
asks which kind of task it runs.

Batches follow :mod:`torchgpu.data.batches`: ``(inputs, target)`` pairs, or dicts
(``model(**batch)``; with no loss given, the loss is the model's ``output.loss``,
``output["loss"]`` or its scalar output; a given loss is called ``loss(output, batch)``).
Metrics are ``{name: metric}`` (:mod:`torchgpu.train.metrics`): a function
``fn(output, target_or_batch) -> float`` averaged over the evaluation samples, or an
object with ``reset``/``update``/``compute`` (torchmetrics-style) for aggregated metrics.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sized
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, IterableDataset

from torchgpu.data.base import ExampleData
from torchgpu.data.batches import DictPairs, check_dict_item, output_loss
from torchgpu.errors import DataError, UsageError
from torchgpu.train import optimizers
from torchgpu.train.metrics import MetricLike, check_metrics
from torchgpu.train.optimizers import OptimizerChoice

LossFn = Callable[[Any, Any], Tensor]
LOSS_NAMES: tuple[str, ...] = ("mse", "cross_entropy")


@dataclass(frozen=True)
class Task:
    """A model factory, data, loss, metrics, default optimizer and evaluation batch.

    ``metrics``: ``{name: metric}``, reported as ``test_<name>``
    (:mod:`torchgpu.train.metrics`). ``optimizer``: the run's optimizer unless
    ``--optimizer`` names another: ``adam``/``adamw``/``sgd`` at ``--lr``, or a function
    ``params -> Optimizer`` (:mod:`torchgpu.train.optimizers`); AdamW for a user's model,
    Adam for the built-in examples (as the seeds). ``scheduler``: a factory
    ``optimizer -> LRScheduler`` (:mod:`torchgpu.train.schedule`; ``--scheduler`` sets
    it), None for the ``--lr-schedule`` one. ``eval_batch_size``: the held-out
    split's batch is at least this many rows (evaluation keeps no activations for
    backward, so it takes larger batches); None: the training batch size.
    ``dict_batches``: the datasets yield dicts (collated by :class:`DictPairs`).
    ``example``: the in-memory tensors of a built-in example or CSV table (the planner
    and the model/pipeline strategies measure on them; a launcher hands a CSV's to its
    workers); None for user data. ``trusted``: the plug-in vouches that its model takes
    its data and loss (the built-in examples do), so the two-sample :func:`probe` before
    ``--out`` exists is skipped (for ResNet-50 it costs a forward). ``kind``: a label for
    summary.json's ``task`` (``regression``, ``classification``, ``custom``); nothing in
    the engine depends on it.
    """

    name: str
    build_model: Callable[[], nn.Module]
    train: Dataset[Any]
    test: Dataset[Any] | None
    loss: LossFn
    metrics: Mapping[str, MetricLike] = field(default_factory=dict)
    optimizer: OptimizerChoice = "adamw"
    scheduler: Callable[[Any], Any] | None = None  # optimizer -> LRScheduler (train/schedule)
    eval_batch_size: int | None = None
    dict_batches: bool = False
    example: ExampleData | None = None
    trusted: bool = False
    kind: str = "custom"
    description: str = ""

    def make_optimizer(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        """The run's optimizer (:attr:`optimizer`) over ``model``'s trainable parameters,
        at ``lr`` for a built-in name. UsageError when a factory fails or returns no
        Optimizer."""
        params = [p for p in model.parameters() if p.requires_grad]
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
    def collate(self) -> Callable[[list[Any]], Any] | None:
        """The DataLoader's collate function (None: torch's default)."""
        return DictPairs() if self.dict_batches else None

    def sample(self, rows: int) -> tuple[Any, Any]:
        """The first ``rows`` training samples as one ``(inputs, target)`` batch
        (cycling when the dataset is smaller): probes, measurements, the planner."""
        from torch.utils.data import TensorDataset

        if isinstance(self.train, IterableDataset):  # a fresh pass: training's untouched
            from torchgpu.data.stream import first_items

            head = first_items(self.train, max(1, rows))
            items = [head[i % len(head)] for i in range(max(1, rows))]
            return self._collated(items)
        n = self.train_rows
        if isinstance(self.train, TensorDataset) and len(self.train.tensors) == 2:
            index = torch.arange(max(1, rows)) % n
            return self.train.tensors[0][index], self.train.tensors[1][index]
        return self._collated([self.train[i % n] for i in range(max(1, rows))])

    def _collated(self, items: list[Any]) -> tuple[Any, Any]:
        from torch.utils.data import default_collate

        if self.dict_batches:
            batch = default_collate(items)
            return batch, batch
        inputs, target = default_collate(items)
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


def _is_dict_dataset(dataset: Dataset[Any], what: str) -> bool:
    if isinstance(dataset, IterableDataset):
        from torchgpu.data.stream import first_items

        head = first_items(dataset, 1)
        if not head:
            raise DataError(f"{what} is a stream that yields no items: there is nothing "
                            "to train on; check the data source")
        return _is_dict_item(head[0], what, "__iter__")
    try:
        item = dataset[0]
    except Exception as error:
        raise DataError(
            f"{what}: reading its first item failed ({type(error).__name__}: {error}); a "
            "map-style Dataset must return a sample for index 0"
        ) from None
    return _is_dict_item(item, what, "__getitem__")


def _is_dict_item(item: object, what: str, source: str) -> bool:
    if isinstance(item, Mapping):
        check_dict_item(item, what)  # tokenizer-style Python lists: refused with the fix
        return True
    if isinstance(item, tuple | list) and len(item) == 2:
        return False
    raise DataError(
        f"{what} returns items of type {type(item).__name__}: the engine takes "
        f"(inputs, target) pairs or dicts of tensors; return one of those from {source}"
    )


def check_dataset(dataset: Any, what: str, *, stream: bool = False) -> Dataset[Any]:
    """``dataset`` if it is a non-empty map-style Dataset or a stream (an
    ``IterableDataset``, where ``stream`` allows one: :mod:`torchgpu.data.stream`), else
    DataError with the fix.
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
    checked: Dataset[Any] = dataset
    return checked


def user_task(build_model: Callable[[], nn.Module], train: Any, test: Any = None,
              loss: LossFn | None = None, metrics: Mapping[str, Any] | None = None,
              name: str = "model") -> Task:
    """A Task for a user's model and datasets (``fit`` and ``--model/--data``): AdamW
    by default, evaluation in training-sized batches.

    Raises DataError for data the engine cannot take (not a map-style Dataset, items that
    are neither pairs nor dicts, train and eval of different shapes), UsageError for pairs
    without a loss or a malformed metric.
    """
    checked = check_metrics(metrics)
    train = check_dataset(train, "the training data", stream=True)
    dict_batches = _is_dict_dataset(train, "the training data")
    if test is not None:
        test = check_dataset(test, "the evaluation data")
        if _is_dict_dataset(test, "the evaluation data") != dict_batches:
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
                metrics=checked, dict_batches=dict_batches)


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


def probe(task: Task, model: nn.Module, *, model_label: str = "the model",
          data_label: str = "the training data") -> None:
    """One forward and loss on the first two training samples, before anything is written.

    A model the data does not fit, a loss that cannot take the model's output, or a model
    with no loss of its own would otherwise fail at the first step, after ``--out`` was
    made; here each is :class:`UsageError` naming the specs (``model_label``,
    ``data_label``) and the fix. The probe runs in the model's training mode (some models
    return their losses only there) without gradients, and leaves no trace: the CPU
    random state and the model's buffers (BatchNorm statistics) are put back.
    """
    from torchgpu.errors import TorchGpuError, first_line
    from torchgpu.transfer import to_device

    inputs, target = task.sample(2)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type != "cpu":  # a user's module already placed: the samples follow it
        inputs, target = to_device((inputs, target), device)
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            if isinstance(inputs, Mapping):
                output = model(**inputs)
            elif isinstance(inputs, tuple | list) and not hasattr(inputs, "_fields"):
                output = model(*inputs)
            else:
                output = model(inputs)
            loss = task.loss(output, target)
    except TorchGpuError as error:  # e.g. output_loss: no loss in the output
        raise UsageError(f"{model_label} on two samples of {data_label}: {error}") from None
    except Exception as error:
        raise UsageError(
            f"{model_label} on two samples of {data_label} failed ({first_line(error)}): "
            "the data's batches must be what the model's forward takes (pairs: "
            "model(inputs), dicts: model(**batch)) and the loss must take the model's "
            "output; check the model and data specs, or pass the loss that fits."
        ) from None
    finally:
        with torch.no_grad():
            for name, value in model.named_buffers():
                if name in buffers:
                    value.copy_(buffers[name])
    if not (isinstance(loss, Tensor) and loss.numel() == 1 and loss.is_floating_point()):
        shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
        raise UsageError(
            f"the loss of {model_label} on {data_label} is {shape}, not a scalar float "
            "tensor: the loss must return one number per batch (e.g. a mean); pass a "
            "loss that reduces, e.g. torch.nn.CrossEntropyLoss()"
        )


def spreads_inputs(task: Task) -> bool:
    """True when the model must be called ``model(**batch)`` / ``model(*inputs)``: dict
    batches, or pairs whose inputs are a tuple/list/dict (plain tensors need nothing)."""
    if task.dict_batches:
        return True
    inputs, _ = task.sample(1)
    return isinstance(inputs, tuple | list | Mapping)
