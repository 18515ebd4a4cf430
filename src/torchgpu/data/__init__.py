"""Built-in data: the housing table, CSV tables, synthetic images, and make_loader.

``example_data(name)`` gives the data of a built-in example (``EXAMPLE_NAMES``);
``csv_data(path, target)`` any numeric CSV table; ``make_loader`` the DataLoader.
"""

from __future__ import annotations

from torchgpu.data.base import ExampleData
from torchgpu.data.csv import csv_data
from torchgpu.data.housing import housing_data, write_housing_csv
from torchgpu.data.images import lenet_data, resnet50_data
from torchgpu.data.loader import make_loader, set_epoch
from torchgpu.errors import DataError

EXAMPLE_NAMES: tuple[str, ...] = ("housing", "lenet", "resnet50")

__all__ = [
    "EXAMPLE_NAMES",
    "ExampleData",
    "csv_data",
    "example_data",
    "make_loader",
    "set_epoch",
    "write_housing_csv",
]


def example_data(
    name: str, seed: int = 0, size: int | None = None, *, num_classes: int | None = None
) -> ExampleData:
    """The data of the built-in example ``name`` (one of :data:`EXAMPLE_NAMES`).

    ``size`` is the total number of samples before the train/test split (defaults:
    housing 506 rows split 80/20; lenet 2560 images split 2048/512; resnet50 72 images
    split 48/24). ``seed`` fixes everything random (the split; the images and labels).
    ``num_classes`` applies to resnet50 only (default 1000, as the seed).
    Raises :class:`DataError` for an unknown name or an unusable size.
    """
    if name == "housing":
        return housing_data(seed=seed, size=size)
    if name == "lenet":
        return lenet_data(seed=seed, size=size)
    if name == "resnet50":
        if num_classes is None:
            return resnet50_data(seed=seed, size=size)
        return resnet50_data(seed=seed, size=size, num_classes=num_classes)
    raise DataError(
        f"unknown example {name!r}: the built-in examples are {', '.join(EXAMPLE_NAMES)}; "
        "or pass your own table with --data FILE --target COLUMN"
    )
