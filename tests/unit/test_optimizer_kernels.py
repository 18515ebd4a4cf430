"""Built-in optimizers take the kernel that suits the parameters' device: fused on CUDA,
torch's default elsewhere (CPU runs stay equal to a hand-written loop); a user's factory is
left alone."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch import nn

from torchgpu.train.recipe import optimizers


def _params(device: str, dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(3, dtype=dtype, device=device)),
            nn.Parameter(torch.zeros(2, dtype=dtype, device=device))]


def test_cpu_parameters_keep_torchs_default() -> None:
    assert optimizers.kernel_options(_params("cpu")) == {}
    made = optimizers.make("adamw", _params("cpu"), lr=0.1)
    assert not made.defaults.get("fused") and made.defaults.get("foreach") is None


def test_a_built_in_optimizer_is_fused_on_cuda_parameters() -> None:
    """Parameters on one CUDA device get fused=True (stand-ins carrying a CUDA device: the
    choice reads the device and dtype only, and naming a device initialises nothing);
    mixed devices or a non-float parameter get the default."""

    class OnDevice:
        def __init__(self, device: str, floating: bool = True) -> None:
            self.device, self.floating = torch.device(device), floating

        def is_floating_point(self) -> bool:
            return self.floating

    def kernel(*params: OnDevice) -> dict[str, bool]:
        return optimizers.kernel_options(list(params))  # type: ignore[arg-type]

    assert kernel(OnDevice("cuda:0"), OnDevice("cuda:0")) == {"fused": True}
    assert kernel(OnDevice("cuda:0"), OnDevice("cuda:1")) == {}
    assert kernel(OnDevice("cuda:0"), OnDevice("cpu")) == {}
    assert kernel(OnDevice("cuda:0"), OnDevice("cuda:0", floating=False)) == {}
    assert not torch.cuda.is_initialized()


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd"])
def test_make_passes_the_kernel_options(name: str) -> None:
    seen: dict[str, object] = {}
    real = optimizers._BUILT_IN[name]

    def spy(params: list[nn.Parameter], **kwargs: object) -> torch.optim.Optimizer:
        seen.update(kwargs)
        return real(params, lr=0.1)

    with mock.patch.dict(optimizers._BUILT_IN, {name: spy}), \
            mock.patch.object(optimizers, "kernel_options", return_value={"fused": True}):
        optimizers.make(name, _params("cpu"), lr=0.1)
    assert seen == {"lr": 0.1, "fused": True}


def test_a_users_factory_is_left_alone() -> None:
    made = optimizers.make(lambda params: torch.optim.AdamW(params, lr=0.5), _params("cpu"),
                           lr=0.1)
    assert made.defaults["lr"] == 0.5 and not made.defaults.get("fused")


@pytest.mark.gpu
def test_fused_adamw_on_cuda() -> None:
    made = optimizers.make("adamw", _params("cuda"), lr=0.1)
    assert made.defaults["fused"] is True
