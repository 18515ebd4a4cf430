"""A TorchFunctionMode that rewrites the device arguments of tensor calls.

Two places run a user's code with its device requests changed: planning keeps CUDA on
the CPU while it builds and measures a model (:mod:`torchgpu.planning.custom`), and the
placement check runs it on fake CUDA, where ``cuda`` means ``cuda:0``
(:mod:`torchgpu.placement`). Both rewrite the same arguments -- ``Tensor.to``'s
positional device, ``Tensor.cuda``'s device and any call's ``device=`` keyword -- and
differ only in the mapping, so :class:`DeviceRewrite` finds the arguments once and a
subclass says what each becomes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


class DeviceRewrite(TorchFunctionMode):
    """While active, ``Tensor.to(..., device, ...)`` and ``device=`` keywords go through
    :meth:`device`, ``tensor.cuda(device)`` becomes :meth:`cuda`, and the call itself
    runs through :meth:`call` (a subclass may rewrite other arguments there)."""

    def device(self, value: object, index_is_device: bool) -> object:
        """What a device argument becomes. ``index_is_device``: a bare int here is a
        device index (``Tensor.to``'s first argument, a ``device=`` keyword), not some
        other number. Values that are not devices (dtypes, tensors) come back as they are."""
        raise NotImplementedError

    def cuda(self, tensor: torch.Tensor, device: object) -> object:
        """What ``tensor.cuda(device)`` returns (``device`` None: no argument given)."""
        raise NotImplementedError

    def call(self, func: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        return func(*args, **kwargs)

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return self.cuda(args[0], args[1] if len(args) > 1 else kwargs.get("device"))
        if func is torch.Tensor.to:
            args = (args[0], *(self.device(a, i == 0) for i, a in enumerate(args[1:])))
        if "device" in kwargs:
            kwargs["device"] = self.device(kwargs["device"], True)
        return self.call(func, args, kwargs)
