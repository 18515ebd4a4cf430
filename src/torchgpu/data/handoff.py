"""An :class:`ExampleData` written to one ``.npz`` file and read back bit for bit.

A launcher that has loaded a CSV table hands it to its torchrun workers this way, so
the table is parsed once per run instead of once per process. The file holds plain
arrays only (read with ``allow_pickle=False``) and a ``key`` describing what the data
was made from; a reader that expects another key gets None and loads the data itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from torchgpu.data.base import ExampleData

_ARRAYS = ("x_train", "y_train", "x_test", "y_test")


def save_example(data: ExampleData, path: str | Path, *, key: dict[str, object]) -> None:
    """Write ``data`` (two-tensor train/test datasets) and ``key`` to ``path``."""
    tensors = (*data.train.tensors, *data.test.tensors)
    # (numpy's stubs refuse **dict[str, ndarray] for savez, hence the loose value type)
    arrays: dict[str, Any] = {n: t.numpy() for n, t in zip(_ARRAYS, tensors, strict=True)}
    meta = {
        "key": key,
        "task": data.task,
        "input_shape": list(data.input_shape),
        "num_outputs": data.num_outputs,
        "feature_names": None if data.feature_names is None else list(data.feature_names),
        "description": data.description,
        "target_name": data.target_name,
        "feature_mean": None if data.feature_mean is None else list(data.feature_mean),
        "feature_std": None if data.feature_std is None else list(data.feature_std),
    }
    encoded = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **arrays, meta=encoded)


def _tuple(value: Any) -> tuple[Any, ...] | None:
    return None if value is None else tuple(value)


def load_example(path: str | Path, *, expected_key: dict[str, object]
                 ) -> ExampleData | None:
    """The ExampleData in ``path``, or None when the file is missing, unreadable or was
    made from something else than ``expected_key`` says (the caller then loads the
    data from its source)."""
    try:
        with np.load(path, allow_pickle=False) as stored:
            meta = json.loads(stored["meta"].tobytes().decode())
            if meta.get("key") != expected_key:
                return None
            arrays = [torch.from_numpy(np.array(stored[name])) for name in _ARRAYS]
    except (OSError, ValueError, KeyError):
        return None
    return ExampleData(
        train=TensorDataset(arrays[0], arrays[1]),
        test=TensorDataset(arrays[2], arrays[3]),
        task=meta["task"],
        input_shape=tuple(meta["input_shape"]),
        num_outputs=int(meta["num_outputs"]),
        feature_names=_tuple(meta["feature_names"]),
        description=str(meta["description"]),
        target_name=meta["target_name"],
        feature_mean=_tuple(meta["feature_mean"]),
        feature_std=_tuple(meta["feature_std"]),
    )
