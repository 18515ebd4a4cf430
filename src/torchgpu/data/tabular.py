"""Seeded train/test split and feature standardisation for numeric tables.

Standardising with train-split statistics only keeps test rows unseen; unstandardised
features give the spiky loss the seeds warn about.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import TensorDataset

from torchgpu.data.base import ExampleData
from torchgpu.errors import DataError


def split_indices(n_rows: int, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(train_idx, test_idx)``: a seeded permutation of ``range(n_rows)`` cut in two.

    The test part has ``round(n_rows * test_fraction)`` rows, at least 1; the train part
    at least 1. Raises :class:`DataError` when that is impossible or the fraction is not
    in (0, 1).
    """
    if not 0.0 < test_fraction < 1.0:
        raise DataError(
            f"test_fraction={test_fraction} is not allowed: it must be strictly between 0 "
            "and 1 (e.g. 0.2 keeps a fifth of the rows for testing)"
        )
    n_test = max(1, round(n_rows * test_fraction))
    if n_rows - n_test < 1:
        raise DataError(
            f"{n_rows} rows cannot be split into train and test sets: at least 2 rows are "
            "needed; add rows to the data"
        )
    order = np.random.default_rng(seed).permutation(n_rows)
    return np.sort(order[n_test:]), np.sort(order[:n_test])


def standardise(
    train: np.ndarray, *others: np.ndarray
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Scale columns to mean 0, std 1 using ``train``'s statistics; constant columns get std 1.

    Statistics are float64 whatever the input's dtype (float32 sums drift on long
    columns); the scaled arrays are float32.
    """
    mean = train.mean(axis=0, dtype=np.float64)
    std = train.std(axis=0, dtype=np.float64)
    std = np.where(std > 0, std, 1.0)
    scaled = [((a - mean) / std).astype(np.float32) for a in (train, *others)]
    return scaled, mean, std


def regression_data(
    features: np.ndarray,
    target: np.ndarray,
    *,
    feature_names: tuple[str, ...],
    target_name: str,
    seed: int,
    test_fraction: float,
    description: str,
) -> ExampleData:
    """Split, standardise the features (train statistics) and wrap as :class:`ExampleData`.

    ``features`` is ``(N, F)``, ``target`` ``(N,)``; the target keeps its units.
    """
    train_idx, test_idx = split_indices(len(features), test_fraction, seed)
    (x_train, x_test), mean, std = standardise(features[train_idx], features[test_idx])
    y = target.astype(np.float32).reshape(-1, 1)
    return ExampleData(
        train=TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y[train_idx])),
        test=TensorDataset(torch.from_numpy(x_test), torch.from_numpy(y[test_idx])),
        task="regression",
        input_shape=(features.shape[1],),
        num_outputs=1,
        feature_names=feature_names,
        description=description,
        target_name=target_name,
        feature_mean=tuple(float(v) for v in mean),
        feature_std=tuple(float(v) for v in std),
    )
