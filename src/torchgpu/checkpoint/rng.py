"""Random-number-generator state as weights-only-safe values.

:func:`capture_rng_state` returns only tensors, ints, floats, lists and dicts, so the
result can be written into ``state.pt`` and read back with ``weights_only=True``:

- ``torch``: the CPU generator state (uint8 tensor);
- ``cuda``: one uint8 tensor per visible GPU, or ``None`` when CUDA was never
  initialised in this process (capturing must not initialise it);
- ``python``: ``random.getstate()`` as ``{"version", "state": [ints], "gauss"}``;
- ``numpy``: numpy's legacy global generator as ``{"kind", "keys": int64 tensor, "pos",
  "has_gauss", "cached_gaussian"}`` (``None`` when numpy is not installed).
"""

from __future__ import annotations

import random
import warnings
from typing import Any, TypedDict

import torch
from torch import Tensor

from torchgpu.devices.cuda_status import cuda_device_count, cuda_initialized
from torchgpu.errors import CheckpointError


class PythonRngState(TypedDict):
    """``random.getstate()`` as plain values."""

    version: int
    state: list[int]
    gauss: float | None


class NumpyRngState(TypedDict):
    """numpy's legacy global RNG state, its key array as a tensor."""

    kind: str
    keys: torch.Tensor
    pos: int
    has_gauss: int
    cached_gaussian: float


class RngState(TypedDict):
    """What :func:`capture_rng_state` returns."""

    torch: Tensor
    cuda: list[Tensor] | None
    python: PythonRngState
    numpy: NumpyRngState | None


def capture_rng_state() -> RngState:
    """The state of every global RNG this process uses (see the module docstring)."""
    version, internal, gauss = random.getstate()
    state: RngState = {
        "torch": torch.get_rng_state(),
        "cuda": None,
        "python": {"version": int(version), "state": [int(x) for x in internal], "gauss": gauss},
        "numpy": _capture_numpy(),
    }
    # Only when already initialised: reading CUDA RNG state would otherwise start CUDA.
    if cuda_initialized() and torch.cuda.is_available():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return state


def _capture_numpy() -> NumpyRngState | None:
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        return None
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {
        "kind": str(kind),
        "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`capture_rng_state` captured.

    Missing entries are left alone. CUDA states are restored only when CUDA is usable;
    on a CPU-only machine (a checkpoint from a GPU run) they are skipped with a warning,
    and when fewer GPUs are visible than were saved, the first ones are restored.
    A malformed state raises :class:`CheckpointError`.
    """
    try:
        if state.get("torch") is not None:
            torch.set_rng_state(state["torch"].cpu())
        py = state.get("python")
        if py is not None:
            random.setstate((int(py["version"]), tuple(int(x) for x in py["state"]), py["gauss"]))
        np_state = state.get("numpy")
        if np_state is not None:
            _restore_numpy(np_state)
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise CheckpointError(
            f"the saved RNG state is malformed ({type(error).__name__}: {error}); it must be a "
            "dict made by capture_rng_state(). Load with restore_rng=False to skip it"
        ) from None
    cuda_states = state.get("cuda")
    if cuda_states:
        _restore_cuda(list(cuda_states))


def _restore_numpy(np_state: dict[str, Any]) -> None:
    import numpy as np

    keys = np.asarray(np_state["keys"].cpu().numpy(), dtype=np.uint32)
    np.random.set_state((
        np_state["kind"], keys, int(np_state["pos"]), int(np_state["has_gauss"]),
        float(np_state["cached_gaussian"]),
    ))


def _restore_cuda(states: list[torch.Tensor]) -> None:
    if not torch.cuda.is_available():
        warnings.warn(
            f"the checkpoint holds CUDA RNG states for {len(states)} GPU(s) but CUDA is not "
            "available here; CUDA random streams are not restored (CPU, python and numpy are)",
            UserWarning, stacklevel=3)
        return
    count = cuda_device_count()
    if count < len(states):
        warnings.warn(
            f"the checkpoint holds CUDA RNG states for {len(states)} GPUs but {count} are "
            f"visible; restoring the first {count}", UserWarning, stacklevel=3)
    for index, cuda_state in enumerate(states[:count]):
        torch.cuda.set_rng_state(cuda_state.cpu(), device=index)
