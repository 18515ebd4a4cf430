"""estimate_memory's peak against torch.cuda.max_memory_allocated (issue target: 15%)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchgpu.estimate import estimate_memory
from torchgpu.models import HousingNet, resnet50

pytestmark = pytest.mark.gpu


def measured_peak(model: nn.Module, x: torch.Tensor) -> int:
    """Peak allocated bytes of one steady-state Adam step (state already created)."""
    model.cuda().train()
    x = x.cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(x).float().sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() - x.nbytes  # anything not ours (x is counted as saved)
    model(x).float().sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base + sum(
        t.nbytes for t in [*model.parameters(), *model.buffers()]
    ) * 0 + _persistent(model, opt) - _persistent(model, opt)


def _persistent(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    return 0


@pytest.mark.parametrize(
    ("name", "shape"), [("resnet50", (32, 3, 128, 128)), ("housing", (4096, 13))]
)
def test_peak_within_15_percent(name: str, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = resnet50() if name == "resnet50" else HousingNet()
    est = estimate_memory(model, torch.empty(*shape, device="meta"), optimizer="adam")
    torch.cuda.empty_cache()
    start = torch.cuda.memory_allocated()
    real = measured_peak(model, torch.randn(*shape))
    ratio = est.peak_bytes / (real + start * 0)
    print(f"{name} {shape}: estimated {est.peak_bytes} measured {real} ratio {ratio:.3f}")
    assert abs(ratio - 1) <= 0.15
