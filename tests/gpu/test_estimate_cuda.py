"""estimate_memory's peak against torch.cuda.max_memory_allocated (issue target: 15%)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchgpu.memory.estimate import estimate_memory
from torchgpu.models import HousingNet, resnet50

pytestmark = pytest.mark.gpu


def measured_peak(model: nn.Module, x_cpu: torch.Tensor) -> int:
    """Peak bytes allocated by model, optimizer state and one steady-state Adam step."""
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    model.cuda().train()
    x = x_cpu.cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):  # the first step creates the optimizer state
        model(x).float().sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    model(x).float().sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


@pytest.mark.parametrize(
    ("name", "shape"), [("resnet50", (32, 3, 128, 128)), ("housing", (4096, 13))]
)
def test_peak_within_15_percent(name: str, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = resnet50() if name == "resnet50" else HousingNet()
    est = estimate_memory(model, torch.empty(*shape, device="meta"), optimizer="adam")
    real = measured_peak(model, torch.randn(*shape))
    ratio = est.peak_bytes / real
    print(f"{name} {shape}: estimated {est.peak_bytes} measured {real} ratio {ratio:.3f}")
    assert abs(ratio - 1) <= 0.15
