"""``--example resnet50``: the seed's ResNet-50 on random 3x128x128 images.

The images of :func:`torchgpu.data.resnet50_data` (72, split 48/24, 1000 classes),
torchgpu's own ResNet-50 (:func:`~torchgpu.models.resnet50`), cross-entropy, accuracy
over the held-out split, Adam. Its ``as_sequential()`` view feeds the model/pipeline
strategies.
"""

from __future__ import annotations

from torch import nn

from torchgpu.data import ExampleData
from torchgpu.examples.common import builtin_data, example_task
from torchgpu.train.config import TrainConfig
from torchgpu.train.metrics import Accuracy
from torchgpu.train.task import Task

NAME = "resnet50"


def load(config: TrainConfig) -> ExampleData:
    """The images for ``config`` (seed, ``--data-size``)."""
    return builtin_data(NAME, config)


def build_model(data: ExampleData) -> nn.Module:
    """ResNet-50 with one output per class of ``data``, from the current RNG."""
    from torchgpu.models import build_model as build

    return build("resnet50", num_classes=data.num_outputs)


def task(config: TrainConfig) -> Task:
    """The plug-in: the images, ResNet-50, cross-entropy, accuracy, Adam."""
    data = load(config)
    return example_task(config, data, lambda: build_model(data), loss=nn.CrossEntropyLoss(),
                        metrics={"accuracy": Accuracy()})
