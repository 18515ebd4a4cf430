"""Built-in models: sizes, torchvision-compatible ResNet-50 layout, sequential views."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from torchgpu.errors import ConfigError
from torchgpu.models import MODEL_NAMES, HousingNet, LeNet5, build_model, resnet50


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def r50() -> nn.Module:
    torch.manual_seed(0)
    return resnet50().eval()


def test_resnet50_has_torchvisions_parameter_count(r50: nn.Module) -> None:
    assert n_params(r50) == 25_557_032


def test_resnet50_class_count_changes_only_the_fc() -> None:
    model = resnet50(num_classes=10)
    # fc: 2048*1000+1000 -> 2048*10+10
    assert n_params(model) == 25_557_032 - (2048 + 1) * 990
    assert model.fc.weight.shape == (10, 2048)


def test_resnet50_state_dict_keys_are_torchvisions(r50: nn.Module) -> None:
    state = r50.state_dict()
    # 161 weights and biases + 53 BatchNorms x 3 buffers (mean, var, num_batches_tracked)
    assert len(state) == 320
    n_bn = sum(isinstance(m, nn.BatchNorm2d) for m in r50.modules())
    assert n_bn == 53
    expected_shapes = {
        "conv1.weight": (64, 3, 7, 7),
        "bn1.running_mean": (64,),
        "layer1.0.downsample.0.weight": (256, 64, 1, 1),
        "layer1.0.downsample.1.num_batches_tracked": (),
        "layer2.0.conv2.weight": (128, 128, 3, 3),
        "layer3.5.bn3.weight": (1024,),
        "layer4.2.conv3.weight": (2048, 512, 1, 1),
        "fc.weight": (1000, 2048),
        "fc.bias": (1000,),
    }
    for key, shape in expected_shapes.items():
        assert tuple(state[key].shape) == shape, key
    blocks = {name.split(".")[0]: int(name.split(".")[1]) for name in state if name[:5] == "layer"}
    assert blocks == {"layer1": 2, "layer2": 3, "layer3": 5, "layer4": 2}  # last index: [3,4,6,3]


def test_resnet50_strides_on_the_3x3_conv_as_torchvision_v1_5(r50: nn.Module) -> None:
    block = r50.layer2[0]
    assert block.conv1.stride == (1, 1)
    assert block.conv2.stride == (2, 2)
    assert block.downsample[0].stride == (2, 2)


def test_resnet50_init_matches_torchvisions_recipe(r50: nn.Module) -> None:
    # kaiming_normal_(fan_out, relu): std = sqrt(2 / (out_channels * k * k))
    w = r50.layer3[0].conv2.weight
    expected = math.sqrt(2.0 / (256 * 3 * 3))
    assert abs(w.std().item() / expected - 1) < 0.05
    assert torch.all(r50.layer3[0].bn1.weight == 1)
    assert torch.all(r50.layer3[0].bn1.bias == 0)
    zero = resnet50(zero_init_residual=True)
    assert torch.all(zero.layer1[0].bn3.weight == 0)


def test_resnet50_sequential_view_equals_forward_and_shares_modules(r50: nn.Module) -> None:
    seq = r50.as_sequential()
    assert isinstance(seq, nn.Sequential) and len(seq) == 6
    assert seq[1] is r50.layer1 and seq[4] is r50.layer4
    assert seq[0].conv1 is r50.conv1 and seq[5].fc is r50.fc
    assert {id(p) for p in seq.parameters()} == {id(p) for p in r50.parameters()}
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(seq(x), r50(x))
        assert seq(x).shape == (2, 1000)


def test_resnet50_view_training_moves_the_models_weights() -> None:
    torch.manual_seed(0)
    model = resnet50(num_classes=4)
    seq = model.as_sequential()
    before = model.fc.weight.detach().clone()
    opt = torch.optim.SGD(seq.parameters(), lr=0.1)
    loss = nn.functional.cross_entropy(seq(torch.randn(2, 3, 32, 32)), torch.tensor([0, 1]))
    loss.backward()
    opt.step()
    assert model.fc.weight.grad is not None
    assert not torch.equal(model.fc.weight, before)


def test_housing_net_is_the_seeds_net1() -> None:
    model = HousingNet()
    assert list(model.state_dict()) == [
        "layer1.0.weight", "layer1.0.bias", "layer2.0.weight", "layer2.0.bias",
        "layer3.0.weight", "layer3.0.bias",
    ]  # fmt: skip
    assert n_params(model) == 13 * 16 + 16 + 16 * 32 + 32 + 32 + 1
    x = torch.randn(5, 13)
    assert model(x).shape == (5, 1)
    assert torch.equal(model.as_sequential()(x), model(x))
    # ReLU really sits between the layers: a negative pre-activation is cut
    manual = model.layer3(torch.relu(model.layer2(torch.relu(model.layer1(x)))))
    assert torch.equal(manual, model(x))


def test_lenet_shapes_and_view() -> None:
    model = LeNet5()
    assert n_params(model) == 61_706
    x = torch.randn(3, 1, 28, 28)
    out = model(x)
    assert out.shape == (3, 10)
    seq = model.as_sequential()
    assert torch.equal(seq(x), out)
    assert {id(p) for p in seq.parameters()} == {id(p) for p in model.parameters()}
    assert LeNet5(num_classes=3)(x).shape == (3, 3)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_build_model_builds_every_name(name: str) -> None:
    model = build_model(name)
    assert isinstance(model, nn.Module)
    assert isinstance(model.as_sequential(), nn.Sequential)  # type: ignore[operator]


def test_build_model_passes_keywords() -> None:
    assert build_model("lenet", num_classes=7).fc3.out_features == 7  # type: ignore[union-attr]
    assert build_model("housing", in_dim=5).layer1[0].in_features == 5  # type: ignore[index]


def test_build_model_rejects_unknown_names_and_arguments() -> None:
    with pytest.raises(ConfigError, match=r"'vgg'.*housing, lenet, resnet50"):
        build_model("vgg")
    with pytest.raises(ConfigError, match=r"num_layers.*num_classes"):
        build_model("lenet", num_layers=3)


def test_models_do_not_touch_cuda() -> None:
    build_model("housing")
    assert not torch.cuda.is_initialized()
