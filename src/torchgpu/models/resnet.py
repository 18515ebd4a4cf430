"""ResNet-50 (Bottleneck blocks [3, 4, 6, 3]), written here to match torchvision's.

Attribute names, state_dict keys and initialisation are those of
``torchvision.models.resnet50`` (v1.5: the stride sits on the 3x3 convolution), so
torchvision weights load with ``load_state_dict`` directly. 25,557,032 parameters at
1000 classes.

:meth:`ResNet.as_sequential` gives the seed's model-parallel view
``Sequential(stem, layer1, layer2, layer3, layer4, head)`` with the same modules, so a
split of the view trains the model itself.
"""

from __future__ import annotations

import torch
from torch import nn


def _conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def _conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand (x4), plus the identity or a projection."""

    expansion = 4

    def __init__(
        self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None
    ) -> None:
        super().__init__()
        width = planes
        self.conv1 = _conv1x1(inplanes, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv3x3(width, width, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = _conv1x1(width, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        result: torch.Tensor = self.relu(out)
        return result


class Stem(nn.Module):
    """conv1 7x7/2, bn1, relu, maxpool 3x3/2 — the modules of the ResNet it came from."""

    def __init__(self, conv1: nn.Module, bn1: nn.Module, relu: nn.Module, maxpool: nn.Module):
        super().__init__()
        self.conv1 = conv1
        self.bn1 = bn1
        self.relu = relu
        self.maxpool = maxpool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        return out


class Head(nn.Module):
    """Global average pool, flatten, fc — the modules of the ResNet it came from."""

    def __init__(self, avgpool: nn.Module, fc: nn.Module) -> None:
        super().__init__()
        self.avgpool = avgpool
        self.fc = fc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(torch.flatten(self.avgpool(x), 1))
        return out


class ResNet(nn.Module):
    """A Bottleneck ResNet; ``layers`` blocks per stage ([3, 4, 6, 3] is ResNet-50).

    Input ``(N, 3, H, W)`` with H, W >= 32; output logits ``(N, num_classes)``.
    ``zero_init_residual`` zeroes each block's last BatchNorm weight, as torchvision's
    option of the same name.
    """

    def __init__(
        self,
        layers: tuple[int, int, int, int] = (3, 4, 6, 3),
        num_classes: int = 1000,
        zero_init_residual: bool = False,
    ) -> None:
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(64, layers[0])
        self.layer2 = self._make_layer(128, layers[1], stride=2)
        self.layer3 = self._make_layer(256, layers[2], stride=2)
        self.layer4 = self._make_layer(512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * Bottleneck.expansion, num_classes)

        # torchvision's initialisation, so a fresh model trains as theirs does.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d | nn.GroupNorm):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, Bottleneck):
                    nn.init.constant_(m.bn3.weight, 0)

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample: nn.Module | None = None
        if stride != 1 or self.inplanes != planes * Bottleneck.expansion:
            downsample = nn.Sequential(
                _conv1x1(self.inplanes, planes * Bottleneck.expansion, stride),
                nn.BatchNorm2d(planes * Bottleneck.expansion),
            )
        layers: list[nn.Module] = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * Bottleneck.expansion
        layers.extend(Bottleneck(self.inplanes, planes) for _ in range(1, blocks))
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        out: torch.Tensor = self.fc(torch.flatten(self.avgpool(x), 1))
        return out

    def as_sequential(self) -> nn.Sequential:
        """``Sequential(stem, layer1, layer2, layer3, layer4, head)`` sharing these modules.

        ``stem`` is conv1+bn1+relu+maxpool, ``head`` avgpool+flatten+fc. Its output equals
        ``forward``'s; moving or training the view moves or trains this model.
        """
        return nn.Sequential(
            Stem(self.conv1, self.bn1, self.relu, self.maxpool),
            self.layer1,
            self.layer2,
            self.layer3,
            self.layer4,
            Head(self.avgpool, self.fc),
        )


def resnet50(num_classes: int = 1000, zero_init_residual: bool = False) -> ResNet:
    """ResNet-50 as torchvision builds it (no weights)."""
    return ResNet((3, 4, 6, 3), num_classes=num_classes, zero_init_residual=zero_init_residual)
