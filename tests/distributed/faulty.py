"""A tiny regression task with faults planted by environment variables, for the tests of
failures that must not be taken for stops (and stops that must end).

As specs: ``torchgpu train --model tests/distributed/faulty.py:model --data
tests/distributed/faulty.py:data --loss mse``; or in a ``torchgpu.fit`` script
(:mod:`tests.distributed.faulty_fit_script`). Each variable is ``WHO:...`` where WHO is
a global rank (a worker: RANK set) or ``single`` (a process without RANK: one process,
or a launcher, which plants nothing by default); faults happen in torchrun's first
round only (``TORCHELASTIC_RESTART_COUNT`` 0), so a restarted round runs clean.

- ``FAULTY_BUILD=WHO:SECONDS``: building the model takes SECONDS longer (a slow start-up).
- ``FAULTY_ITEM=WHO:N:ACTION[,WHO:N:ACTION...]``: loading the N-th item this process
  (or DataLoader worker) loads, and every later one, does ACTION: ``kill`` (SIGKILL
  this process: a crash), ``sleep=S`` (S seconds, once) or ``forever`` (a
  ``__getitem__`` that never returns).
- ``FAULTY_MARK=PATH``: each fault first appends a line to PATH (``kill 0 pid 123``...).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset


def _mine(variable: str) -> list[str] | None:
    """The fields after WHO of the first of ``variable``'s comma-separated faults that is
    for this process, in the first round; else None."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    for fault in os.environ.get(variable, "").split(","):
        who, *rest = fault.split(":")
        if fault and who == os.environ.get("RANK", "single"):
            return rest
    return None


def _mark(words: str) -> None:
    path = os.environ.get("FAULTY_MARK")
    if path:
        with open(path, "a") as file:
            file.write(f"{words} {os.environ.get('RANK', 'single')} pid {os.getpid()}\n")


class Rows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``n`` rows of y = sum(x) with 4 features."""

    def __init__(self, n: int) -> None:
        generator = torch.Generator().manual_seed(n)
        self.x = torch.randn(n, 4, generator=generator)
        self.y = self.x.sum(1, keepdim=True)
        self.loaded = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.loaded += 1
        fault = _mine("FAULTY_ITEM")
        if fault is not None and self.loaded >= int(fault[0]):
            action = fault[1]
            if action == "kill":
                _mark("kill")
                os.kill(os.getpid(), signal.SIGKILL)
            elif action.startswith("sleep=") and self.loaded == int(fault[0]):
                _mark("sleep")
                time.sleep(float(action.split("=", 1)[1]))
            elif action == "forever":
                _mark("forever")
                while True:
                    time.sleep(1.0)
        return self.x[index], self.y[index]


def model() -> nn.Module:
    fault = _mine("FAULTY_BUILD")
    if fault is not None:
        _mark("build")
        time.sleep(float(fault[0]))
    return nn.Linear(4, 1)


def data() -> tuple[Rows, Rows]:
    return Rows(int(os.environ.get("FAULTY_ROWS", "64"))), Rows(16)


def marks(path: Path) -> list[str]:
    """The lines FAULTY_MARK collected (none: [])."""
    return path.read_text().splitlines() if path.exists() else []
