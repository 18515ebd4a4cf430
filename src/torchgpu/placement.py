"""Check a model-parallel placement on fake GPUs, on a machine without any GPU.

:func:`check_placement` builds the model and runs one forward pass under PyTorch's
``FakeTensorMode``: tensors on ``cuda:N`` exist only as shapes, dtypes and devices, so
no GPU (and no memory at the model's size) is needed. Forward pre-hooks compare every
module's own parameters and buffers with the devices of its inputs, so a broken split
is reported by module name (the first mismatch, where a real run would stop)::

    layer3.0.conv1: weight on cuda:0 but input on cuda:1

and an error raised when an operation mixes devices is attributed to the innermost
module running at the time (on fake CUDA: :mod:`torchgpu.fake_cuda`). Use it in a test
suite::

    from torchgpu.placement import check_placement

    def test_two_gpu_split_is_consistent():
        report = check_placement(MyModelParallelNet, (2, 3, 128, 128),
                                 devices=["cuda:0", "cuda:1"])
        assert report.ok, report.format()

"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from torchgpu.errors import DeviceSpecError, first_line
from torchgpu.fake_cuda import fake_cuda

_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")

@dataclass(frozen=True)
class PlacementReport:
    """The outcome of :func:`check_placement`.

    ``ok`` is True when no problem was found. ``problems`` are one line each, naming the
    module. ``parameter_devices`` maps each device to the number of parameters and
    buffers on it; ``output_device`` is where the output ended up (None if the forward
    failed). ``error`` is set (and ``ok`` False, ``problems`` empty) when the placement
    could not be checked at all: the factory raised, or the forward failed for a reason
    that is not about devices (a wrong input shape, a bug in ``forward``). ``kind`` is
    ``"ok"``, ``"broken"`` (a placement problem) or ``"error"``.
    """

    ok: bool
    problems: list[str] = field(default_factory=list)
    parameter_devices: dict[str, int] = field(default_factory=dict)
    input_device: str = "cuda:0"
    output_device: str | None = None
    error: str | None = None

    @property
    def kind(self) -> str:
        """``"ok"``, ``"broken"`` or ``"error"`` (see the class docstring)."""
        if self.error is not None:
            return "error"
        return "ok" if self.ok else "broken"

    def format(self) -> str:
        """A short human-readable summary."""
        if self.error is not None:
            return f"placement not checked: {self.error}"
        where = ", ".join(f"{d}: {n}" for d, n in sorted(self.parameter_devices.items()))
        head = f"placement {'OK' if self.ok else 'BROKEN'} (tensors per device: {where}; "
        head += f"input on {self.input_device}, output on {self.output_device or '-'})"
        return "\n".join([head, *(f"  - {p}" for p in self.problems)])


def _check_devices(devices: Sequence[str] | None) -> list[str] | None:
    if devices is None:
        return None
    out = []
    for d in devices:
        text = str(d).strip()
        if not _DEVICE.match(text):
            raise DeviceSpecError(
                f"device {text!r} cannot be faked: use cpu, cuda or cuda:N (e.g. "
                "devices=['cuda:0', 'cuda:1'])"
            )
        out.append("cuda:0" if text == "cuda" else text)
    if not out:
        raise DeviceSpecError("devices=[] names no device: give at least one, e.g. ['cuda:0']")
    return out


def _own_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [
        *module.named_parameters(recurse=False),
        *((n, b) for n, b in module.named_buffers(recurse=False) if b is not None),
    ]


class _StopForward(Exception):
    """Raised by a hook at the first mismatch: the real run would fail right there."""


# A failed operation is a placement problem when its message is about devices: fake
# tensors say "found two different devices cuda:0, cuda:1", real ones "Expected all
# tensors to be on the same device".
_ABOUT_DEVICES = re.compile(r"\bdevices?\b|\bcuda:\d+\b.*\b(?:cpu|cuda:\d+)\b", re.IGNORECASE)


def _gpu_hint(error: BaseException) -> str:
    """Why a CUDA-looking failure happens on fake devices, or "" for other errors."""
    if "cuda" not in str(error).lower():
        return ""
    return (
        " The check runs on fake devices, so the factory and forward must not call the "
        "CUDA runtime directly (torch.cuda.* functions, streams)."
    )


def about_devices(error: BaseException) -> bool:
    """Whether ``error`` (raised by an operation in the checked forward) is a device
    mismatch -- a placement problem -- rather than a shape or code error."""
    return bool(_ABOUT_DEVICES.search(str(error)))


@contextlib.contextmanager
def quiet_fake_tensor_logs() -> Iterator[None]:
    """Silence torch's fake-tensor loggers within the block.

    When an operation fails on fake tensors, torch logs the whole traceback
    (``E... fake_tensor.py:...] failed while attempting to run meta for aten.mm``) before
    raising; the caller reports the error itself, in one line.
    """
    import logging

    for name in ("torch._subclasses.fake_tensor", "torch._subclasses.functional_tensor"):
        logging.getLogger(name)  # make sure the family exists before it is listed
    loggers = [
        logging.getLogger(name)
        for name in list(logging.root.manager.loggerDict)
        if name.startswith("torch._subclasses")
    ]
    before = [logger.disabled for logger in loggers]
    for logger in loggers:
        logger.disabled = True
    try:
        yield
    finally:
        for logger, disabled in zip(loggers, before, strict=True):
            logger.disabled = disabled


def check_placement(
    model_factory: Callable[[], nn.Module],
    input_shape: Sequence[int],
    devices: Sequence[str] | None = None,
    *,
    input_dtype: torch.dtype = torch.float32,
) -> PlacementReport:
    """Build ``model_factory()`` and run one forward on fake devices; report mismatches.

    ``model_factory`` must build the model and place it (``.to("cuda:1")`` etc.) itself:
    it runs under ``FakeTensorMode``, so nothing is allocated and no GPU is needed.
    The input, of ``input_shape`` and ``input_dtype``, is put on ``devices[0]`` (default:
    the device of the model's first parameter). A parameter or buffer on a device not
    in ``devices`` is a problem too. Raises :class:`DeviceSpecError` for a device that
    cannot be faked; problems in the model are reported, not raised: a placement
    mismatch in ``problems``, and a factory that raises or a forward that fails for a
    reason other than devices (e.g. ``input_shape`` does not fit the first layer) in
    ``error``. Torch's log lines about the failed operation are silenced.
    """
    allowed = _check_devices(devices)
    problems: list[str] = []
    running: list[str] = []
    flagged: set[str] = set()
    handles: list[RemovableHandle] = []
    counts: dict[str, int] = {}
    output_device: str | None = None
    off_list: dict[str, list[str]] = {}  # device not in `devices` -> tensor names
    input_device = allowed[0] if allowed else "cuda:0"

    def note(module_name: str, text: str) -> None:
        if module_name not in flagged:
            flagged.add(module_name)
            problems.append(text)

    def stop(module_name: str, text: str) -> None:
        note(module_name, text)
        raise _StopForward

    def pre_hook(
        name: str,
    ) -> Callable[[nn.Module, tuple[object, ...], dict[str, object]], None]:
        def hook(module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
            running.append(name)
            label = name or type(module).__name__
            inputs = {
                str(t.device) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
            }
            own = _own_tensors(module)
            own_devices = {str(t.device) for _, t in own}
            if len(own_devices) > 1:
                where = ", ".join(f"{n} on {t.device}" for n, t in own)
                stop(name, f"{label}: its own tensors are on different devices ({where})")
            elif len(inputs) > 1:
                stop(name, f"{label}: inputs on different devices ({', '.join(sorted(inputs))})")
            elif inputs and own_devices and inputs != own_devices:
                pname, tensor = own[0]
                stop(
                    name,
                    f"{label}: {pname} on {tensor.device} but input on {next(iter(inputs))}",
                )

        return hook

    def post_hook(_module: nn.Module, _args: tuple[object, ...], _out: object) -> None:
        if running:
            running.pop()

    try:
        # no_grad for the factory too: an autograd node on a fake CUDA tensor (e.g. from
        # nn.Parameter(p.to("cuda:1"))) aborts the process on a CPU-only build.
        with quiet_fake_tensor_logs(), fake_cuda(), torch.no_grad():
            try:
                model = model_factory()
            except Exception as error:
                return PlacementReport(
                    ok=False,
                    input_device=input_device,
                    error=(
                        f"model_factory() failed: {first_line(error)}. Fix the factory so "
                        f"that it builds and places the model.{_gpu_hint(error)}"
                    ),
                )
            if not isinstance(model, nn.Module):
                return PlacementReport(
                    ok=False, input_device=input_device,
                    error=(f"model_factory() returned a {type(model).__name__}, not an "
                           "nn.Module: the factory must return the model, e.g. "
                           "def build() -> nn.Module."))
            for name, module in model.named_modules():
                handles.append(module.register_forward_pre_hook(pre_hook(name), with_kwargs=True))
                handles.append(module.register_forward_hook(post_hook))
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                device = str(tensor.device)
                counts[device] = counts.get(device, 0) + 1
                if allowed is not None and device not in allowed:
                    off_list.setdefault(device, []).append(name)
            if allowed is None:
                first = next(iter([*model.parameters(), *model.buffers()]), None)
                input_device = str(first.device) if first is not None else "cpu"
            x = torch.empty(tuple(input_shape), dtype=input_dtype, device=input_device)
            try:
                out = model(x)
                leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
                output_device = str(leaves[0].device) if leaves else None
            except _StopForward:
                pass
            except Exception as error:
                where = running[-1] if running else ""
                label = where or type(model).__name__
                if about_devices(error):
                    note(where, f"{label}: forward failed: {first_line(error)}")
                else:
                    shape = ",".join(str(d) for d in input_shape)
                    failure = (
                        f"the forward on an input of shape {shape} failed in {label}: "
                        f"{first_line(error)}. That is not a placement problem: check the "
                        "input shape (batch first, as the forward takes it; --input-shape "
                        f"of torchgpu doctor) and the forward's code.{_gpu_hint(error)}"
                    )
                    return PlacementReport(
                        ok=False,
                        parameter_devices=counts,
                        input_device=input_device,
                        error=failure,
                    )
    finally:
        for handle in handles:
            handle.remove()
    for device, names in off_list.items():
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        problems.append(
            f"{len(names)} parameters/buffers are on {device}, which is not among the devices "
            f"{', '.join(allowed or [])}: {shown}"
        )
    return PlacementReport(
        ok=not problems,
        problems=problems,
        parameter_devices=counts,
        input_device=input_device,
        output_device=output_device,
    )
