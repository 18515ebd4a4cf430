"""``--example housing``: the seeds' housing regression (the ``make demo`` run).

The synthetic Boston-shaped housing table (:func:`torchgpu.data.housing_data`: 506 rows,
13 standardised features, split 80/20), the seeds' two-hidden-layer net
(:class:`~torchgpu.models.HousingNet`), MSE, R² over the held-out split, Adam.
"""

from __future__ import annotations

from torch import nn

from torchgpu.data import ExampleData
from torchgpu.examples.common import builtin_data, example_task
from torchgpu.train.config import TrainConfig
from torchgpu.train.metrics import R2
from torchgpu.train.task import Task

NAME = "housing"


def load(config: TrainConfig) -> ExampleData:
    """The housing table for ``config`` (seed, ``--data-size``)."""
    return builtin_data(NAME, config)


def build_model(data: ExampleData) -> nn.Module:
    """The housing net for ``data``'s features (one output), from the current RNG."""
    from torchgpu.models import build_model as build

    return build("housing", in_dim=data.input_shape[0], out_dim=data.num_outputs)


def regression_task(config: TrainConfig, data: ExampleData) -> Task:
    """The housing net on a regression table (this example's, or a CSV's)."""
    return example_task(config, data, lambda: build_model(data), loss=nn.MSELoss(),
                        metrics={"r2": R2()})


def task(config: TrainConfig) -> Task:
    """The plug-in: the housing table, net, MSE, R², Adam."""
    return regression_task(config, load(config))
