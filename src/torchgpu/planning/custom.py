"""Plan a user's model (``torchgpu plan --model module:factory``): build and measure it
safely, so that a failure is one paragraph (exit 2) and never a traceback.

The factory and the measured forward run under :func:`cuda_kept_on_cpu`: every request
for a CUDA device (``.to("cuda:1")``, ``.cuda()``, ``nn.Linear(..., device="cuda:0")``,
``torch.empty(..., device="cuda")``) keeps the tensor on the CPU. A model that places
its own layers (seed 002's ``seq1.to("cuda:0")`` / ``seq2.to("cuda:1")``) is thereby
measured like any other -- the memory the planner counts does not depend on where the
layers are, and the planner chooses the placement itself -- and no GPU is touched (a
CPU-only machine plans for hypothetical GPUs). Direct CUDA API calls
(``torch.cuda.current_device()``, streams) are not rewritten; a factory or forward that
makes them fails with a message that says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from torchgpu.errors import TorchGpuError, UsageError
from torchgpu.planning.footprint import Footprint


def _on_cpu(device: Any) -> Any:
    """``device`` with CUDA replaced by the CPU; anything else unchanged."""
    if isinstance(device, str) and device.strip().lower().startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _KeepOnCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU (see the module docstring)."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]  # stays where it is: on the CPU (or meta)
        if func is torch.Tensor.to:
            args = tuple(
                "cpu" if i == 1 and isinstance(a, int) and not isinstance(a, bool) else _on_cpu(a)
                for i, a in enumerate(args)
            )
        if "device" in kwargs:
            device = kwargs["device"]
            is_index = isinstance(device, int) and not isinstance(device, bool)
            kwargs["device"] = "cpu" if is_index else _on_cpu(device)
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_kept_on_cpu() -> Iterator[None]:
    """Within the block, tensors asked to go to (or be made on) CUDA stay on the CPU."""
    with _KeepOnCpu():
        yield


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0].rstrip('. ') if lines else ''}".rstrip(": ")


def _gpu_hint(error: BaseException) -> str:
    """Why a CUDA-looking failure happens while planning, or "" for other errors."""
    if "cuda" not in str(error).lower():
        return ""
    return (
        " Planning runs the factory and one forward on the CPU, with placements on cuda:N "
        "kept there, so they must not call the CUDA runtime directly (torch.cuda.* "
        "functions, streams)."
    )


def build_custom_model(spec: str) -> nn.Module:
    """Resolve ``spec`` (``module:factory``, see :func:`torchgpu.factories.resolve_model`)
    and build the model on the CPU.

    Raises :class:`UsageError` (exit 2) naming the spec and the failure when the spec
    cannot be resolved, the factory raises, or it returns something else than an
    ``nn.Module``.
    """
    from torchgpu.factories import resolve_model

    try:
        with cuda_kept_on_cpu():
            return resolve_model(spec)
    except UsageError as error:
        cause = error.__cause__
        hint = _gpu_hint(cause) if cause is not None else ""
        if not hint:
            raise
        raise UsageError(f"{error}{hint}") from cause


def measure_custom_model(
    model: nn.Module,
    spec: str,
    sample_batch: torch.Tensor,
    optimizer: str = "adam",
    precision: str = "fp32",
) -> Footprint:
    """:func:`torchgpu.planning.measure.measure_footprint` of a ``--model`` model, with
    a forward that fails (a wrong ``--input-shape``, a GPU-only call) reported as a
    :class:`UsageError` naming the module that was running; torch's own log lines about
    the failed operation are silenced. Errors of torchgpu (unknown optimizer...) pass."""
    from torchgpu.placement import quiet_fake_tensor_logs
    from torchgpu.planning.measure import measure_footprint

    running: list[str] = []
    handles: list[Any] = []

    def enter(name: str) -> Callable[[nn.Module, Any], None]:
        def hook(_module: nn.Module, _args: Any) -> None:
            running.append(name)

        return hook

    def leave(_module: nn.Module, _args: Any, _out: Any) -> None:
        if running:
            running.pop()

    for name, module in model.named_modules():
        if name:
            handles.append(module.register_forward_pre_hook(enter(name)))
            handles.append(module.register_forward_hook(leave))
    try:
        with quiet_fake_tensor_logs(), cuda_kept_on_cpu():
            return measure_footprint(model, sample_batch, optimizer=optimizer, precision=precision)
    except TorchGpuError:
        raise
    except Exception as error:
        where = f" in {running[-1]}" if running else ""
        shape = ",".join(str(d) for d in sample_batch.shape)
        raise UsageError(
            f"--model {spec}: the forward on a batch of shape {shape} failed{where}: "
            f"{_first_line(error)}. Check --input-shape (the shape of a sample batch, batch "
            f"first, as the model's forward takes it) and the forward's code.{_gpu_hint(error)}"
        ) from None
    finally:
        for handle in handles:
            handle.remove()
