"""Shared test set-up: the gpu marker skips without CUDA; tests run single-threaded
so two xdist workers share the 2-core CI machine fairly; the ``run_device`` fixture."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))


# `TORCHGPU_TEST_DEVICE=cuda` re-runs the tests taking the `run_device` fixture on a GPU
# (benchmarks/gpu/kit.py does, with `-m device`); unset, they run on the CPU.
TEST_DEVICE_ENV = "TORCHGPU_TEST_DEVICE"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"device: takes the run_device fixture ({TEST_DEVICE_ENV} picks the device)"
    )
    # pytest-xdist registers it too; without xdist (-p no:xdist) --strict-markers would
    # refuse tests.procs.HEAVY
    config.addinivalue_line("markers", "xdist_group(name): run on one xdist worker")


@pytest.fixture
def run_device() -> torch.device:
    """The device a device-sensitive test runs on: ``$TORCHGPU_TEST_DEVICE``, default cpu."""
    import torch

    spec = os.environ.get(TEST_DEVICE_ENV, "").strip() or "cpu"
    if spec.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip(f"{TEST_DEVICE_ENV}={spec} but no CUDA GPU is visible")
    return torch.device(spec)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the marker must be there by then
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    torch.set_num_threads(1)
    for item in items:
        if "run_device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.device)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
