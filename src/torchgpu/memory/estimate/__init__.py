"""Plan before you run: how much memory training a model takes, per device.

:func:`estimate_memory` combines exact arithmetic for parameters, gradients and
optimizer state with activation bytes measured on fake tensors (no real allocation at
the model's size). Example::

    import torch
    from torchgpu.memory.estimate import estimate_memory
    from torchgpu.models import resnet50

    est = estimate_memory(resnet50(), torch.empty(64, 3, 224, 224, device="meta"),
                          optimizer="adam", precision="bf16", strategy="ddp", world_size=4)
    print(est.format())
    est.fits(80 * 2**30)   # does each rank fit an 80 GiB GPU?
"""

from __future__ import annotations

from torchgpu.memory.estimate.activations import ActivationProfile, measure_activations
from torchgpu.memory.estimate.arithmetic import OPTIMIZERS, optimizer_kind, state_bytes
from torchgpu.memory.estimate.estimator import STRATEGIES, estimate_memory
from torchgpu.memory.estimate.result import DeviceMemory, MemoryEstimate, bytes_per_sample

__all__ = [
    "OPTIMIZERS",
    "STRATEGIES",
    "ActivationProfile",
    "DeviceMemory",
    "MemoryEstimate",
    "bytes_per_sample",
    "estimate_memory",
    "measure_activations",
    "optimizer_kind",
    "state_bytes",
]
