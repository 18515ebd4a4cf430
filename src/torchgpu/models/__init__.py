"""Built-in models: the seeds' housing MLP, LeNet-5, ResNet-50 (own code).

``build_model(name, **kw)`` builds one by name; every model here has ``as_sequential()``
returning an ``nn.Sequential`` that shares its modules, for model/pipeline parallelism.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from torchgpu.errors import ConfigError
from torchgpu.models.housing import HousingNet
from torchgpu.models.lenet import LeNet5
from torchgpu.models.resnet import ResNet, resnet50

MODEL_NAMES: tuple[str, ...] = ("housing", "lenet", "resnet50")

__all__ = ["MODEL_NAMES", "HousingNet", "LeNet5", "ResNet", "build_model", "resnet50"]


def build_model(name: str, **kwargs: Any) -> nn.Module:
    """Build the built-in model ``name`` (one of :data:`MODEL_NAMES`) on the CPU.

    Keyword arguments go to its constructor: ``HousingNet(in_dim, n_hidden_1, n_hidden_2,
    out_dim)``, ``LeNet5(num_classes)``, ``resnet50(num_classes, zero_init_residual)``.
    Raises :class:`ConfigError` for an unknown name or constructor argument.
    """
    builders: dict[str, Any] = {"housing": HousingNet, "lenet": LeNet5, "resnet50": resnet50}
    builder = builders.get(name)
    if builder is None:
        raise ConfigError(
            f"unknown model {name!r}: the built-in models are {', '.join(MODEL_NAMES)}; "
            "pick one of them or pass your own nn.Module"
        )
    try:
        inspect.signature(builder).bind(**kwargs)
    except TypeError as error:
        allowed = ", ".join(inspect.signature(builder).parameters)
        raise ConfigError(
            f"model {name!r} does not take the arguments {sorted(kwargs)} ({error}); "
            f"it accepts: {allowed}"
        ) from None
    model: nn.Module = builder(**kwargs)
    return model
