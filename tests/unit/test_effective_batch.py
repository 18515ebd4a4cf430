"""--effective-batch-size with a fixed --batch-size: the global batch a script means,
kept with accumulation for any number of data-parallel processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torchgpu.errors import UsageError
from torchgpu.train.config import TrainConfig
from torchgpu.train.guards.auto_batch import batch_line, fixed_effective
from torchgpu.train.runner import train


def test_the_accumulation_follows_from_the_global_batch() -> None:
    config = TrainConfig(batch_size=4, effective_batch_size=16)
    assert fixed_effective(config, 1).accumulate == 4
    two = fixed_effective(config, 2)
    assert (two.accumulate, two.effective_batch_size) == (2, None)
    assert batch_line(two, 2) == ("batch: 4 samples per process and micro-batch x 2 "
                                  "accumulation x 2 process(es) = 16 samples per optimizer "
                                  "step (global batch)")
    auto = TrainConfig(auto_batch_size=True, effective_batch_size=16)
    assert fixed_effective(auto, 2) == auto  # the search keeps it
    with pytest.raises(UsageError, match=r"--effective-batch-size 16 is not a multiple of "
                       r"--batch-size 4 x 3 processes = 12.*12 or 24"):
        fixed_effective(config, 3)


def test_one_process_trains_as_with_the_accumulation(tmp_path: Path) -> None:
    base = {"example": "housing", "data_size": 100, "epochs": 1, "batch_size": 8,
            "progress": "off", "device": "cpu"}
    a = train(TrainConfig(out=str(tmp_path / "a"), effective_batch_size=16, **base))
    b = train(TrainConfig(out=str(tmp_path / "b"), accumulate=2, **base))
    assert a.summary["accumulate"] == 2 and a.summary["global_batch"] == 16
    for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values(), strict=True):
        assert torch.equal(x, y)
