"""``--example lenet``: LeNet-5 on synthetic 1x28x28 digit-like images, 10 classes.

The images of :func:`torchgpu.data.lenet_data` (2560, split 2048/512),
:class:`~torchgpu.models.LeNet5`, cross-entropy, accuracy over the held-out split, Adam.
"""

from __future__ import annotations

from torch import nn

from torchgpu.data import ExampleData
from torchgpu.examples.common import builtin_data, example_task
from torchgpu.train.config import TrainConfig
from torchgpu.train.metrics import Accuracy
from torchgpu.train.task import Task

NAME = "lenet"


def load(config: TrainConfig) -> ExampleData:
    """The images for ``config`` (seed, ``--data-size``)."""
    return builtin_data(NAME, config)


def build_model(data: ExampleData) -> nn.Module:
    """LeNet-5 with one output per class of ``data``, from the current RNG."""
    from torchgpu.models import build_model as build

    return build("lenet", num_classes=data.num_outputs)


def task(config: TrainConfig) -> Task:
    """The plug-in: the images, LeNet-5, cross-entropy, accuracy, Adam."""
    data = load(config)
    return example_task(config, data, lambda: build_model(data), loss=nn.CrossEntropyLoss(),
                        metrics={"accuracy": Accuracy()})
