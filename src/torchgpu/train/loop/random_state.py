"""The random state at the start of an accumulation window, kept so that a replay of the
window (the out-of-memory back-off, :mod:`.backoff`) draws the numbers the first try drew."""

from __future__ import annotations

import torch
from torch import Tensor


class WindowRandomState:
    """The random state at the start of the window being run, so that a replay draws the
    numbers the first try drew (dropout masks): a run that backs off then trains as one
    started at the smaller micro-batch, bitwise on CPU.

    :meth:`mark` (the loop, when a window starts) keeps the CPU generator's state and, on
    a CUDA device, that device's (seed and offset, read on the host: no sync);
    :meth:`restore` puts them back before a replay. A window's forward and backward draw
    from these only (data order comes from the loader's own generator); Python's and
    numpy's generators are not kept. Keeping the CPU state copies ~5 KB (~2 us), so it
    is paid only by steps that draw: if the random state did not move over the first
    window, the step draws nothing and marking stops (``armed`` False) for the run.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        dev = torch.device(device) if device is not None else torch.device("cpu")
        self._cuda: torch.device | None = dev if dev.type == "cuda" else None
        self._saved: tuple[Tensor, Tensor | None] | None = None
        self._checked = False  # the first window's draws were looked at
        #: False once the step was seen to draw no random numbers: nothing to keep.
        self.armed = True

    def _capture(self) -> tuple[Tensor, Tensor | None]:
        cuda = torch.cuda.get_rng_state(self._cuda) if self._cuda is not None else None
        return torch.get_rng_state(), cuda

    def mark(self) -> None:
        """A window starts: keep the random state (see the class docstring)."""
        now = self._capture()
        if not self._checked and self._saved is not None:
            self._checked = True
            before = self._saved
            if torch.equal(now[0], before[0]) and (
                    now[1] is None or before[1] is None or torch.equal(now[1], before[1])):
                self.armed, self._saved = False, None  # the step draws nothing
                return
        self._saved = now

    def restore(self) -> None:
        """Back to the state :meth:`mark` kept (no-op before the first mark, or unarmed)."""
        if self._saved is None:
            return
        torch.set_rng_state(self._saved[0])
        if self._cuda is not None and self._saved[1] is not None:
            torch.cuda.set_rng_state(self._saved[1], self._cuda)
