"""``--example resnet50``: the seed's ResNet-50 on random 3x128x128 images.

The images of :func:`torchgpu.data.resnet50_data` (72, split 48/24, 1000 classes),
torchgpu's own ResNet-50 (:func:`~torchgpu.models.resnet50`), cross-entropy, accuracy
over the held-out split, Adam. Its ``as_sequential()`` view feeds the model/pipeline
strategies.
"""

from __future__ import annotations

from torchgpu.examples.common import classifier_task
from torchgpu.train.config import TrainConfig
from torchgpu.train.task import Task

NAME = "resnet50"


def task(config: TrainConfig) -> Task:
    """The plug-in: the images, ResNet-50, cross-entropy, accuracy, Adam."""
    return classifier_task(NAME, config)
