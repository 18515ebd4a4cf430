"""``--example lenet``: LeNet-5 on synthetic 1x28x28 digit-like images, 10 classes.

The images of :func:`torchgpu.data.lenet_data` (2560, split 2048/512),
:class:`~torchgpu.models.LeNet5`, cross-entropy, accuracy over the held-out split, Adam.
"""

from __future__ import annotations

from torchgpu.examples.common import classifier_task
from torchgpu.train.config import TrainConfig
from torchgpu.train.task import Task

NAME = "lenet"


def task(config: TrainConfig) -> Task:
    """The plug-in: the images, LeNet-5, cross-entropy, accuracy, Adam."""
    return classifier_task(NAME, config)
