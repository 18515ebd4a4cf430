"""Fake-GPU placement checks: the seed's model-parallel ResNet-50 on a CPU-only machine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from torchgpu.errors import DeviceSpecError
from torchgpu.models.resnet import ResNet
from torchgpu.placement import check_placement


class ModelParallelResNet50(ResNet):
    """Seed 002's split: conv1..layer2 on cuda:0, layer3, layer4, avgpool and fc on cuda:1."""

    def __init__(self) -> None:
        super().__init__((3, 4, 6, 3), num_classes=1000)
        self.seq1 = nn.Sequential(
            self.conv1, self.bn1, self.relu, self.maxpool, self.layer1, self.layer2
        ).to("cuda:0")
        self.seq2 = nn.Sequential(self.layer3, self.layer4, self.avgpool).to("cuda:1")
        self.fc.to("cuda:1")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.seq2(self.seq1(x).to("cuda:1"))
        out: torch.Tensor = self.fc(x.view(x.size(0), -1))
        return out


class LeftBehindLayer3(ModelParallelResNet50):
    """The planted bug: the model starts on cuda:0 and only layer4 and avgpool move."""

    def __init__(self) -> None:
        ResNet.__init__(self, (3, 4, 6, 3), num_classes=1000)
        self.to("cuda:0")
        self.seq1 = nn.Sequential(
            self.conv1, self.bn1, self.relu, self.maxpool, self.layer1, self.layer2
        )
        self.seq2 = nn.Sequential(self.layer3, self.layer4, self.avgpool)
        self.layer4.to("cuda:1")
        self.avgpool.to("cuda:1")
        self.fc.to("cuda:1")


DEVICES = ["cuda:0", "cuda:1"]


def test_seed_model_parallel_resnet50_passes() -> None:
    report = check_placement(ModelParallelResNet50, (2, 3, 128, 128), DEVICES)
    assert report.ok, report.format()
    assert report.problems == []
    assert report.output_device == "cuda:1" and report.input_device == "cuda:0"
    assert set(report.parameter_devices) == {"cuda:0", "cuda:1"}
    assert "placement OK" in report.format()
    assert not torch.cuda.is_initialized()


def test_planted_mistake_names_layer3() -> None:
    report = check_placement(LeftBehindLayer3, (2, 3, 128, 128), DEVICES)
    assert not report.ok
    assert report.problems == ["layer3.0.conv1: weight on cuda:0 but input on cuda:1"]
    assert report.output_device is None
    assert "BROKEN" in report.format() and "layer3.0.conv1" in report.format()
    assert not torch.cuda.is_initialized()


class Small(nn.Module):
    """Created directly on fake devices, with .cuda(), dropout and batch-norm in training."""

    def __init__(self, second: str = "cuda:1") -> None:
        super().__init__()
        self.a = nn.Linear(4, 8, device="cuda:0")
        self.norm = nn.BatchNorm1d(8).cuda()
        self.drop = nn.Dropout(0.5)
        self.b = nn.Linear(8, 2).to(second)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.norm(self.a(x)))
        out: torch.Tensor = self.b(h.to(self.b.weight.device))
        return out


def test_devices_made_every_usual_way_pass() -> None:
    report = check_placement(Small, (3, 4), DEVICES)
    assert report.ok, report.format()
    assert report.parameter_devices == {"cuda:0": 7, "cuda:1": 2}  # batch-norm has 5


def test_input_defaults_to_the_first_parameters_device() -> None:
    report = check_placement(Small, (3, 4))
    assert report.ok and report.input_device == "cuda:0"


def test_a_device_outside_the_list_is_reported() -> None:
    report = check_placement(lambda: Small("cuda:2"), (3, 4), DEVICES)
    assert not report.ok
    assert report.problems == [
        "2 parameters/buffers are on cuda:2, which is not among the devices cuda:0, cuda:1: "
        "b.weight, b.bias"
    ]


class MixedInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4).to("cuda:0")
        self.b = nn.Linear(4, 4).to("cuda:1")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the mistake is a bare op, not a module: attributed to the running module
        out: torch.Tensor = self.a(x) + self.b(x.to("cuda:1"))
        return out


def test_mixing_devices_outside_a_submodule_is_attributed_to_the_running_module() -> None:
    report = check_placement(MixedInputs, (2, 4), DEVICES)
    assert not report.ok
    assert len(report.problems) == 1
    assert report.problems[0].startswith("MixedInputs: forward failed:")
    assert "cuda:0" in report.problems[0] and "cuda:1" in report.problems[0]


def test_split_parameters_within_one_module() -> None:
    def factory() -> nn.Module:
        layer = nn.Linear(4, 4).to("cuda:0")
        layer.bias = nn.Parameter(layer.bias.to("cuda:1"))
        return nn.Sequential(layer)

    report = check_placement(factory, (2, 4), DEVICES)
    assert report.problems[0].startswith("0: its own tensors are on different devices")


def test_factory_errors_are_reported_and_bad_devices_refused() -> None:
    def broken() -> nn.Module:
        raise ValueError("no such layer")

    report = check_placement(broken, (1,), DEVICES)
    assert (report.ok, report.kind, report.problems) == (False, "error", [])
    assert report.error is not None
    assert report.error.startswith("model_factory() failed: ValueError: no such layer. Fix")
    assert report.format().startswith("placement not checked: model_factory() failed")
    with pytest.raises(DeviceSpecError, match="'gpu1'"):
        check_placement(Small, (3, 4), ["gpu1"])
    nothing = check_placement(lambda: None, (1,), DEVICES)  # type: ignore[arg-type,return-value]
    assert nothing.error is not None and nothing.error.startswith(
        "model_factory() returned a NoneType, not an nn.Module")


def test_a_wrong_input_shape_is_an_error_not_a_placement_problem(
    capfd: pytest.CaptureFixture[str],
) -> None:
    report = check_placement(Small, (3, 5), DEVICES)  # the first layer takes 4 features
    assert (report.ok, report.kind, report.problems) == (False, "error", [])
    assert report.error is not None
    assert "failed in a: RuntimeError" in report.error and "3,5" in report.error
    assert "not a placement problem" in report.error and "input shape" in report.error
    assert "BROKEN" not in report.format()
    # torch logs the failed fake operation with a traceback; the check silences it
    out, err = capfd.readouterr()
    assert "fake_tensor" not in err + out and "Traceback" not in err + out
    import logging

    assert not logging.getLogger("torch._subclasses.fake_tensor").disabled  # restored


def test_kinds() -> None:
    assert check_placement(Small, (3, 4), DEVICES).kind == "ok"
    assert check_placement(LeftBehindLayer3, (2, 3, 64, 64), DEVICES).kind == "broken"
    assert check_placement(MixedInputs, (2, 4), DEVICES).kind == "broken"  # about devices


def test_a_cuda_runtime_call_says_why_it_fails() -> None:
    def needs_the_runtime() -> nn.Module:
        # what torch.cuda.set_device(1) raises on a CPU-only build
        raise AssertionError("Torch not compiled with CUDA enabled")

    report = check_placement(needs_the_runtime, (3, 4), DEVICES)
    assert report.kind == "error" and report.error is not None
    assert "must not call the CUDA runtime" in report.error
    plain = check_placement(lambda: nn.Linear("x", 2), (3, 4), DEVICES)  # type: ignore[arg-type]
    assert plain.kind == "error" and "CUDA runtime" not in (plain.error or "")


def test_doctor_maps_errors_to_exit_2_and_broken_placement_to_1(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from torchgpu.cli.main import main

    models = tmp_path / "models.py"
    models.write_text(
        "from torch import nn\n"
        "def good():\n"
        "    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))\n"
        "    m[0].to('cuda:0'); m[1].to('cuda:1'); return m\n"
        "def boom():\n"
        "    raise RuntimeError('factory failed')\n"
    )
    args = ["doctor", "--devices", "cuda:0,cuda:1", "--model"]
    # nn.Sequential does not move between its layers: a real placement bug
    assert main([*args, f"{models}:good", "--input-shape", "2,8"]) == 1
    assert "BROKEN" in capfd.readouterr().out
    assert main([*args, f"{models}:good", "--input-shape", "2,9"]) == 2
    out, err = capfd.readouterr()
    assert out == "" and "check the input shape" in err and "Traceback" not in err
    assert "fake_tensor.py" not in err and len(err.strip().splitlines()) == 1
    assert main([*args, f"{models}:boom", "--input-shape", "2,8"]) == 2
    out, err = capfd.readouterr()
    assert out == "" and "boom" in err and "factory failed" in err and "BROKEN" not in err


def test_the_check_leaves_no_trace() -> None:
    swap = torch.utils.swap_tensors
    check_placement(Small, (3, 4), DEVICES)
    assert torch.utils.swap_tensors is swap
    layer = nn.Linear(2, 2)
    assert layer.weight.device.type == "cpu" and torch.isfinite(layer.weight).all()
    assert not torch.cuda.is_initialized()
