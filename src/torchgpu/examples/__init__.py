"""The built-in examples, each a plug-in: the same interface a user's specs provide.

A plug-in is a function ``task(config: TrainConfig) -> Task``
(:class:`~torchgpu.train.task.Task`): a model factory seeded by ``config.seed``, the
training and held-out datasets (:mod:`torchgpu.data`), the loss, the metrics
(:mod:`torchgpu.train.metrics`), the default optimizer and the evaluation batch size --
what ``--model``/``--data``/``--loss`` specs or :func:`torchgpu.fit` give for a user's
model. The engine runs every Task alike; nothing in it tests an example's name.

- ``housing`` (:mod:`~torchgpu.examples.housing`): the seeds' regression net, MSE, R²;
- ``lenet`` (:mod:`~torchgpu.examples.lenet`): LeNet-5, cross-entropy, accuracy;
- ``resnet50`` (:mod:`~torchgpu.examples.resnet50`): ResNet-50, cross-entropy, accuracy;
- ``--data FILE.csv --target COL`` (:mod:`~torchgpu.examples.table`): the housing net on
  a CSV table.
"""

from __future__ import annotations

from collections.abc import Callable

from torchgpu.examples import housing, lenet, resnet50, table
from torchgpu.train.config import TrainConfig
from torchgpu.train.task import Task

PlugIn = Callable[[TrainConfig], Task]
#: ``--example NAME`` -> its plug-in (the names are :data:`torchgpu.train.config.EXAMPLES`).
PLUGINS: dict[str, PlugIn] = {
    "housing": housing.task,
    "lenet": lenet.task,
    "resnet50": resnet50.task,
}

__all__ = ["PLUGINS", "PlugIn", "task_for"]


def task_for(config: TrainConfig) -> Task:
    """The built-in plug-in's Task for ``config`` (validated, resolved): the CSV table's
    for ``--data FILE --target COL``, else ``--example``'s (housing by default)."""
    if config.data is not None:
        return table.task(config)
    return PLUGINS[config.example or "housing"](config)
