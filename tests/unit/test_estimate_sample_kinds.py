"""A model with ``as_sequential()`` fed dict or tuple batches: its sequential view takes
one input, so estimate_memory, the planner's footprint and plan measure such a sample
through the model's own forward (the engine trains it that way), and refuse only what
really needs the view (split/pipeline, segment checkpointing) with a clear message."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from torchgpu import estimate_memory
from torchgpu.errors import ConfigError
from torchgpu.planning.measure import measure_footprint
from torchgpu.planning.planner import plan_for_training


class AsSeq(nn.Module):
    """Two stages, offered as layers by ``as_sequential()`` (as torchgpu advises)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.b = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))

    def forward(self, image: Tensor, label: Tensor | None = None) -> Tensor:
        return self.b(self.a(image))

    def as_sequential(self) -> nn.Sequential:
        return nn.Sequential(self.a, self.b)


class TwoInputs(AsSeq):
    def forward(self, image: Tensor, scale: Tensor) -> Tensor:  # type: ignore[override]
        return self.b(self.a(image * scale))


def _image(rows: int = 16) -> Tensor:
    return torch.empty(rows, 3, 8, 8, device="meta")


SAMPLES: dict[str, tuple[nn.Module, Any]] = {
    "dict": (AsSeq(), {"image": _image(), "label": torch.zeros(16, dtype=torch.long)}),
    "tuple": (TwoInputs(), (_image(), torch.empty(16, 1, 1, 1, device="meta"))),
}


@pytest.mark.parametrize("kind", list(SAMPLES))
@pytest.mark.parametrize("strategy", ["single", "ddp", "fsdp"])
def test_estimate_takes_dict_and_tuple_samples(kind: str, strategy: str) -> None:
    model, sample = SAMPLES[kind]
    got = estimate_memory(model, sample, strategy=strategy, world_size=2)
    # the same forward as the tensor sample through the view: the same bytes
    assert got == estimate_memory(model.as_sequential(), _image(), strategy=strategy,
                                  world_size=2)


@pytest.mark.parametrize("kind", list(SAMPLES))
def test_planner_measures_and_plans_them(kind: str) -> None:
    model, sample = SAMPLES[kind]
    footprint = measure_footprint(model, sample)
    assert footprint.layers == () and not footprint.checkpointable  # no view for this batch
    plan = plan_for_training(model, sample, 16, "2x1GiB")
    assert plan.chosen.strategy in ("single", "ddp", "fsdp")
    rows = {c.strategy: c for c in plan.candidates}
    assert not rows["pipeline"].applicable and not rows["model"].applicable


def test_what_needs_the_view_is_refused_clearly() -> None:
    model, sample = SAMPLES["dict"]
    with pytest.raises(ConfigError, match=r"one tensor from stage to stage.*dict \(image, label"):
        estimate_memory(model, sample, strategy="pipeline", world_size=2)
    with pytest.raises(ConfigError, match="sequential view, which takes one input"):
        estimate_memory(model, sample, activation_checkpointing=True)
    # a single tensor still goes through the view: layers, checkpointing, pipeline
    assert estimate_memory(model, _image(), strategy="pipeline", world_size=2).balance == (1, 1)
    assert measure_footprint(model, _image()).layers
