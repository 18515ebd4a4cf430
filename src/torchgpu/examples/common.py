"""What the built-in plug-ins share: their data, checked against the batch, and their Task.

Every built-in example trains with Adam at ``--lr`` (as the seeds) and evaluates its
held-out split in batches of at least :data:`EVAL_BATCH_SIZE` rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import nn

from torchgpu.data import ExampleData, example_data
from torchgpu.errors import DataError
from torchgpu.train.config import TrainConfig
from torchgpu.train.metrics import Accuracy, MetricLike
from torchgpu.train.task import LossFn, Task, seeded

#: The seeds' optimizer (``--optimizer`` replaces it).
OPTIMIZER = "adam"
#: Rows per evaluation batch at least (more when the training batch is larger).
EVAL_BATCH_SIZE = 256


def builtin_data(name: str, config: TrainConfig) -> ExampleData:
    """The data of the built-in example ``name`` for ``config`` (its seed and
    ``--data-size``). DataError when the train split holds fewer rows than one batch of
    ``config.batch_size`` (the loader would silently make one smaller batch); not
    under ``--batch-size auto``, whose search fits the batch to the data."""
    data = example_data(name, seed=config.seed, size=config.data_size)
    n_train, n_test = len(data.train), len(data.test)
    if config.fixed_batch_size is not None and n_train < config.fixed_batch_size:
        more = " or a larger --data-size" if config.data_size is not None else ""
        raise DataError(
            f"example {name} has {n_train + n_test} samples, so the train split holds "
            f"{n_train} (test {n_test}), fewer than one batch of {config.batch_size}: use "
            f"--batch-size {n_train} or less{more}"
        )
    return data


def example_task(config: TrainConfig, data: ExampleData, build_model: Callable[[], nn.Module],
                 *, loss: LossFn, metrics: Mapping[str, MetricLike]) -> Task:
    """The Task of a built-in plug-in: ``data``'s splits, ``build_model`` seeded by
    ``config.seed``, ``loss`` and ``metrics``, Adam, evaluation batches of at least
    :data:`EVAL_BATCH_SIZE`; ``data`` kept as the task's in-memory example; trusted (the
    built-in models take their data: no probe before ``--out``)."""
    return Task(name=config.run_name, build_model=seeded(build_model, config.seed),
                train=data.train, test=data.test, loss=loss, metrics=dict(metrics),
                optimizer=OPTIMIZER, eval_batch_size=EVAL_BATCH_SIZE, kind=data.task,
                example=data, trusted=True, description=data.description)


def classifier_task(name: str, config: TrainConfig) -> Task:
    """The Task of a built-in image classifier ``name`` (``lenet``, ``resnet50``): its
    images, the model of that name from :func:`torchgpu.models.build_model` with one
    output per class, cross-entropy and accuracy."""
    data = builtin_data(name, config)

    def build_model() -> nn.Module:
        from torchgpu.models import build_model as build

        return build(name, num_classes=data.num_outputs)

    return example_task(config, data, build_model, loss=nn.CrossEntropyLoss(),
                        metrics={"accuracy": Accuracy()})
