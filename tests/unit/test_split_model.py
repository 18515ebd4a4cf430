"""split_model: equals the plain model; placement owned; canonical keys; errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from torchgpu.errors import BalanceError, ConfigError, DeviceSpecError, NoDeviceError
from torchgpu.parallel.model import SplitModel, split_model
from torchgpu.parallel.pipeline import build_pipeline_model


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    )


class TwoPart(nn.Module):
    """A model that is not a Sequential but offers a sequential view."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def as_sequential(self) -> nn.Sequential:
        return nn.Sequential(self.body, self.head)


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("stages", [1, 2, 3, 5])
def test_split_equals_plain(stages: int, run_device: torch.device) -> None:
    """Every stage on ``run_device`` (the GPU check: ``cuda:0`` for each stage, streams)."""
    devices = [str(run_device)] * stages
    ref = mlp().to(run_device)
    split = split_model(copy.deepcopy(ref), devices)
    assert len(split.partitions) == len(devices) and sum(split.balance) == 5
    assert split.input_device.type == split.output_device.type == run_device.type
    x = torch.randn(9, 6).to(run_device)
    out_ref, out = ref(x), split(x)
    torch.testing.assert_close(out, out_ref)
    out.square().mean().backward()
    out_ref.square().mean().backward()
    for a, b in zip(grads(split), grads(ref), strict=True):
        torch.testing.assert_close(a, b)


def test_balance_list_and_layers_shared() -> None:
    model = mlp()
    split = split_model(model, ["cpu", "cpu"], balance=[1, 4])
    assert split.balance == (1, 4)
    assert split.partitions[0][0] is model[0] and split.partitions[1][3] is model[4]
    assert split.output_device == torch.device("cpu") and split.input_device == torch.device("cpu")


def test_list_of_stages_and_as_sequential() -> None:
    a, b = nn.Linear(3, 5), nn.Linear(5, 2)
    split = split_model([a, b], ["cpu", "cpu"])
    assert split.balance == (1, 1)
    x = torch.randn(4, 3)
    torch.testing.assert_close(split(x), b(a(x)))

    ref = TwoPart()
    split2 = split_model(copy.deepcopy(ref), ["cpu", "cpu"])
    x4 = torch.randn(4, 4)
    torch.testing.assert_close(split2(x4), ref(x4))
    assert list(split2.state_dict()) == list(ref.state_dict())


def test_builtin_models_split_if_present() -> None:
    models = pytest.importorskip("torchgpu.models")
    build = getattr(models, "build_model", None)
    if build is None:
        pytest.skip("torchgpu.models.build_model not available yet")
    ref = build("housing")
    split = split_model(copy.deepcopy(ref), ["cpu", "cpu"])
    x = torch.randn(5, 13)
    torch.testing.assert_close(split(x), ref(x))


def test_state_dict_keys_are_canonical_and_load_back(run_device: torch.device) -> None:
    ref = mlp(3)  # saved on the CPU, loaded into stages on run_device
    split = split_model(mlp(4), [run_device, run_device])
    assert list(split.state_dict()) == list(ref.state_dict())
    split.load_state_dict(ref.state_dict())
    assert all(p.device.type == run_device.type for p in split.parameters())
    x = torch.randn(2, 6)
    torch.testing.assert_close(split(x.to(run_device)).cpu(), ref(x))


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.to("cpu"),
        lambda m: m.to(torch.device("cpu"), torch.float64),
        lambda m: m.to(device="cpu"),
        lambda m: m.to(torch.zeros(1)),
        lambda m: m.cuda(),
        lambda m: m.cpu(),
    ],
)
def test_moving_is_refused(call: object) -> None:
    split = split_model(mlp(), ["cpu", "cpu"])
    with pytest.raises(
        ConfigError, match=r"places its stages itself \(stage 0 on cpu, stage 1 on cpu\)"
    ):
        call(split)  # type: ignore[operator]


def test_dtype_conversion_is_allowed() -> None:
    split = split_model(mlp(), ["cpu", "cpu"])
    assert split.to(torch.float64) is split
    assert all(p.dtype == torch.float64 for p in split.parameters())
    assert split(torch.randn(2, 6, dtype=torch.float64)).dtype == torch.float64


def test_bad_inputs() -> None:
    with pytest.raises(
        BalanceError, match=r"covers 4 layers but the model has 5.*try balance=\[3, 2\]"
    ):
        split_model(mlp(), ["cpu", "cpu"], balance=[2, 2])
    with pytest.raises(BalanceError, match="6 stages requested but the model has only 5 layers"):
        split_model(mlp(), ["cpu"] * 6)
    with pytest.raises(BalanceError, match="balance='time' needs sample"):
        split_model(mlp(), ["cpu", "cpu"], balance="time")
    with pytest.raises(BalanceError, match="'fast' is not known"):
        split_model(mlp(), ["cpu", "cpu"], balance="fast")  # type: ignore[arg-type]
    with pytest.raises(DeviceSpecError, match="'gpu7' is not a device"):
        split_model(mlp(), ["cpu", "gpu7"])
    with pytest.raises(DeviceSpecError, match="non-empty list"):
        split_model(mlp(), "cpu")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cannot split a Linear"):
        split_model(nn.Linear(2, 2), ["cpu"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_cuda() -> None:
    with pytest.raises(NoDeviceError, match="cuda:1 requested but CUDA is not available"):
        split_model(mlp(), ["cpu", "cuda:1"])
    assert not torch.cuda.is_initialized()


def test_size_and_time_balance_run() -> None:
    sample = torch.randn(8, 6)
    for balance in ("size", "time"):
        split = split_model(mlp(), ["cpu", "cpu"], balance=balance, sample=sample)  # type: ignore[arg-type]
        assert sum(split.balance) == 5 and len(split.balance) == 2


def test_build_pipeline_model() -> None:
    model = build_pipeline_model(mlp(), "model", ["cpu", "cpu"])
    assert type(model) is SplitModel
    pipe = build_pipeline_model(mlp(), "pipeline", ["cpu", "cpu"], chunks=3, checkpoint="never")
    assert pipe.chunks == 3  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="'ddp' is not a split strategy"):
        build_pipeline_model(mlp(), "ddp", ["cpu"])  # type: ignore[arg-type]
