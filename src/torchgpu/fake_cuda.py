"""Fake CUDA devices on a CPU-only machine: :func:`fake_cuda` runs a block under
PyTorch's ``FakeTensorMode``, where tensors on ``cuda:N`` exist only as shapes, dtypes
and devices (used by :func:`torchgpu.placement.check_placement`).

How fake CUDA works on a CPU-only PyTorch build, and what had to be worked around
(each workaround is active only inside the block):

- ``module.to("cuda:N")`` on fake parameters swaps tensors, which PyTorch refuses while
  the fake mode's memo holds a weak reference to them; the memo entries of the two
  tensors are dropped just before the swap.
- Random initialisation directly on a fake CUDA tensor (``nn.Linear(..., device=
  "cuda:0")``) needs a CUDA generator; on fake CUDA tensors it is skipped (values do
  not matter for placement).
- ``.cuda()`` / ``.to("cuda")`` without an index would ask CUDA for the current device;
  it means ``cuda:0``.
- Batch-norm in training mode updates its running statistics with a copy a CPU build
  cannot do on fake CUDA; the check runs batch-norm without updating them.
- The factory and the pass run under ``torch.no_grad()``: recording autograd on fake
  CUDA tensors (and backward) aborts the process on a CPU-only build. Placement of the
  backward follows the forward's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from torchgpu.device_rewrite import DeviceRewrite
from torchgpu.fake_checks import IndexDtypeCheck

_RANDOM_FILLS = {
    torch.ops.aten.uniform_.default,
    torch.ops.aten.normal_.default,
    torch.ops.aten.random_.default,
    torch.ops.aten.random_.to,
    getattr(torch.ops.aten.random_, "from"),
    torch.ops.aten.bernoulli_.float,
    torch.ops.aten.exponential_.default,
    torch.ops.aten.cauchy_.default,
    torch.ops.aten.log_normal_.default,
    torch.ops.aten.geometric_.default,
}


def _normal_device(device: object) -> object:
    """``cuda`` without an index means cuda:0 (asking CUDA would fail without a GPU)."""
    if isinstance(device, str) and device == "cuda":
        return "cuda:0"
    if isinstance(device, torch.device) and device.type == "cuda" and device.index is None:
        return torch.device("cuda", 0)
    return device


class _FakeCudaFunctions(DeviceRewrite):
    """Rewrites the calls a CPU-only build cannot run on fake CUDA (see the module docstring)."""

    def device(self, value: object, index_is_device: bool) -> object:
        return _normal_device(value)

    def cuda(self, tensor: torch.Tensor, device: object) -> object:
        if device is None or isinstance(device, int):
            return tensor.to(torch.device("cuda", device or 0))
        if not isinstance(device, (str, torch.device)):
            raise TypeError(f"Tensor.cuda() got device {device!r}")
        wanted = torch.device(device)
        if wanted.index is None:  # cuda means cuda:0 (asking CUDA would fail without a GPU)
            wanted = torch.device(wanted.type, 0)
        return tensor.to(wanted)

    def call(self, func: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        if func is F.batch_norm:
            bound = _batch_norm_args(*args, **kwargs)
            if bound["training"]:
                bound["running_mean"] = bound["running_var"] = None
            return func(**bound)
        return func(*args, **kwargs)


def _batch_norm_args(
    input: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> dict[str, object]:
    return {
        "input": input, "running_mean": running_mean, "running_var": running_var,
        "weight": weight, "bias": bias, "training": training, "momentum": momentum, "eps": eps,
    }  # fmt: skip


class _SkipRandomFillOnFakeCuda(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """In-place random fills of fake CUDA tensors are skipped (no CUDA generator exists)."""

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func in _RANDOM_FILLS and args and args[0].device.type == "cuda":
            return args[0]
        return func(*args, **(kwargs or {}))


def _no_gpu_context(device: torch.device) -> None:
    """Stands in for FakeTensor's ``init_gpu_context`` during the check (see fake_cuda)."""


@contextlib.contextmanager
def fake_cuda() -> Iterator[FakeTensorMode]:
    """Fake CUDA devices on the CPU for the block: the fake tensor mode, with the
    workarounds of the module docstring active."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo = mode.fake_tensor_converter.tensor_memo
    original_swap = torch.utils.swap_tensors
    # Where CUDA is available, torch makes a real tensor on every device a fake tensor
    # names (fake_tensor.init_gpu_context): a CUDA context on each GPU the model names,
    # and "invalid device ordinal" for the seed's cuda:1 on a one-GPU machine. The check
    # never runs backward (what that context is for), so it runs as on a CPU-only build.
    import torch._subclasses.fake_tensor as fake_tensor_module

    original_init = fake_tensor_module.init_gpu_context
    setattr(fake_tensor_module, "init_gpu_context", _no_gpu_context)  # noqa: B010

    def swap(t1: torch.Tensor, t2: torch.Tensor) -> None:
        # Module._apply swaps fake parameters; the memo's weak references block it.
        for key in [k for k, v in list(memo.items()) if v is t1 or v is t2]:
            del memo[key]
        original_swap(t1, t2)  # type: ignore[no-untyped-call]

    torch.utils.swap_tensors = swap
    try:
        with mode, _SkipRandomFillOnFakeCuda(), _FakeCudaFunctions(), IndexDtypeCheck():  # type: ignore[no-untyped-call]
            yield mode
    finally:
        torch.utils.swap_tensors = original_swap
        setattr(fake_tensor_module, "init_gpu_context", original_init)  # noqa: B010
