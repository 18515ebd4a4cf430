"""ExampleData: a ready train/test split plus what a training loop needs to know about it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch.utils.data import TensorDataset

Task = Literal["regression", "classification"]


@dataclass(frozen=True)
class ExampleData:
    """A train/test split of in-memory tensors.

    ``train``/``test`` hold ``(inputs, targets)``. Regression targets are float32 of shape
    ``(N, 1)`` (so ``MSELoss(model(x), y)`` never broadcasts); classification targets
    are int64 class indices of shape ``(N,)`` for ``CrossEntropyLoss``.
    ``input_shape`` is one sample's shape (no batch dimension); ``num_outputs`` is the
    model's output width (1 for regression, the class count for classification).
    ``feature_mean``/``feature_std`` are the train-split statistics the features were
    standardised with (tabular data only), to standardise new rows the same way.
    """

    train: TensorDataset
    test: TensorDataset
    task: Task
    input_shape: tuple[int, ...]
    num_outputs: int
    feature_names: tuple[str, ...] | None
    description: str
    target_name: str | None = None
    feature_mean: tuple[float, ...] | None = None
    feature_std: tuple[float, ...] | None = None
