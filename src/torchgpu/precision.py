"""Mixed precision as one object: the autocast dtype and, for fp16, the GradScaler.

``Precision`` answers three questions a training loop asks every step:
which autocast context to run the forward in, how to call ``backward`` (scaled or not),
and whether the optimizer step really happened (fp16 skips steps whose gradients
overflowed). It never patches the optimizer; the loop calls it explicitly.

Modes:

- ``fp32``: no autocast, no scaler (the default, and always correct).
- ``bf16``: autocast to bfloat16; no scaler (bf16 has fp32's exponent range).
- ``fp16``: autocast to float16 plus ``torch.amp.GradScaler("cuda")``; CUDA only.
- ``auto``: ``bf16`` on a CUDA device whose GPU supports it natively, else ``fp32``.
  Never bf16 on CPU: bf16 autocast was measured ~100x slower than fp32 on a
  CPU without native bf16 units.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any, TypedDict

import torch

from torchgpu.errors import ConfigError

MODES: tuple[str, ...] = ("fp32", "bf16", "fp16", "auto")

_DTYPES: dict[str, torch.dtype | None] = {
    "fp32": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def _as_device(device: torch.device | str) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(
            f"Precision got device {device!r}, which torch does not understand: "
            "pass a torch.device or a string such as 'cpu', 'cuda' or 'cuda:0'."
        ) from exc


def _cuda_has_native_bf16(device: torch.device) -> bool:
    # Only asked for CUDA devices, so a CPU run never touches torch.cuda.
    if not torch.cuda.is_available():
        return False
    try:
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # older signature without including_emulation
        return bool(torch.cuda.is_bf16_supported())


def resolve_mode(mode: str, device: torch.device | str) -> str:
    """The concrete mode (``fp32``/``bf16``/``fp16``) that ``mode`` means on ``device``.

    Raises ConfigError for an unknown mode or for fp16 off CUDA.
    """
    dev = _as_device(device)
    if not isinstance(mode, str) or mode.lower() not in MODES:
        raise ConfigError(
            f"unknown precision {mode!r}: use one of {', '.join(MODES)} "
            "(fp16 needs a CUDA GPU; auto picks bf16 on GPUs that support it, else fp32)."
        )
    mode = mode.lower()
    if mode == "auto":
        return "bf16" if dev.type == "cuda" and _cuda_has_native_bf16(dev) else "fp32"
    if mode == "fp16" and dev.type != "cuda":
        raise ConfigError(
            f"precision fp16 was requested on device {dev}, but fp16 autocast with loss "
            "scaling is only supported on CUDA GPUs: use --precision bf16 or fp32 on "
            f"{dev.type}, or run on a CUDA device."
        )
    return mode


class PrecisionState(TypedDict):
    """What :meth:`Precision.state_dict` returns."""

    mode: str
    scaler: dict[str, Any] | None  # GradScaler.state_dict()


class Precision:
    """Autocast context + optional GradScaler for one device.

    Attributes: ``mode`` (resolved: ``"fp32"``, ``"bf16"`` or ``"fp16"``), ``requested``
    (what the caller asked for, e.g. ``"auto"``), ``device``, ``dtype`` (the autocast
    dtype, ``None`` for fp32) and ``scaler`` (a ``torch.amp.GradScaler`` for fp16, else
    ``None``).

    On CUDA, construct it after :func:`torchgpu.distributed.init_distributed` (``auto``
    queries the GPU, which initialises CUDA on the current device).

    Typical step::

        with prec.autocast():
            loss = loss_fn(model(x), y)
        prec.backward(loss)
        prec.unscale_(opt)                 # only needed before clipping
        clip_grad_norm_(model.parameters(), 1.0)
        stepped = prec.step(opt)           # False if fp16 gradients overflowed
        opt.zero_grad(set_to_none=True)
    """

    def __init__(self, mode: str = "fp32", device: torch.device | str = "cpu") -> None:
        self.requested: str = mode
        self.device: torch.device = _as_device(device)
        self.mode: str = resolve_mode(mode, self.device)
        self.dtype: torch.dtype | None = _DTYPES[self.mode]
        self.scaler: torch.amp.GradScaler | None = (
            torch.amp.GradScaler("cuda") if self.mode == "fp16" else None
        )

    def __repr__(self) -> str:
        return f"Precision(mode={self.mode!r}, device={str(self.device)!r})"

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Context for the forward pass and loss: autocast to ``dtype``, or nothing for fp32."""
        if self.dtype is None:
            yield
            return
        with torch.autocast(device_type=self.device.type, dtype=self.dtype):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, multiplied by the loss scale when a scaler is in use."""
        if self.scaler is not None:
            torch.autograd.backward(self.scaler.scale(loss))
        else:
            torch.autograd.backward(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the loss scale in place (no-op without a scaler).

        Call at most once per optimizer step, after the last backward and before
        gradient clipping; ``step`` then does not unscale again.
        """
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Apply the optimizer step; return False when the GradScaler skipped it.

        With a scaler this also calls ``scaler.update()``. A skip (inf/NaN gradients)
        is detected by the scale shrinking in ``update()``; reading the scale costs one
        host-device sync per step, only in fp16 mode.
        """
        if self.scaler is None:
            optimizer.step()
            return True
        scale_before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        # update() multiplies the scale by backoff_factor (< 1) exactly when inf/NaN
        # gradients were found, i.e. when step() skipped optimizer.step().
        return not self.scaler.get_scale() < scale_before

    def state_dict(self) -> PrecisionState:
        """``{"mode": str, "scaler": dict | None}``; only ints, floats and strings."""
        return {
            "mode": self.mode,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the loss-scaler state saved by :meth:`state_dict`.

        Resuming in a different mode is allowed (e.g. fp16 on a GPU, then fp32 on a
        CPU): the scaler state is then ignored, with a warning.
        """
        if not isinstance(state, dict) or "mode" not in state:
            raise ConfigError(
                f"Precision.load_state_dict got {type(state).__name__} without a 'mode' key: "
                "pass the dict returned by Precision.state_dict()."
            )
        saved_mode = state["mode"]
        scaler_state = state.get("scaler")
        if saved_mode != self.mode:
            warnings.warn(
                f"precision state was saved in mode {saved_mode!r} and is loaded in mode "
                f"{self.mode!r}; the loss-scaler state is not carried over.",
                stacklevel=2,
            )
            return
        if self.scaler is not None and scaler_state:
            self.scaler.load_state_dict(scaler_state)
