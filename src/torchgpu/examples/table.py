"""``--data FILE.csv --target COL``: the housing net on any numeric CSV table.

The table is parsed, split and standardised by :func:`torchgpu.data.csv_data`; the
plug-in is the housing example's (:func:`torchgpu.examples.housing.regression_task`:
its net sized to the table's features, MSE, R², Adam). ``--model SPEC`` on a CSV keeps
this data with the user's model (:mod:`torchgpu.train.plugin`).

A launcher that relaunches itself under torchrun parses the CSV once and hands it to its
workers (:func:`data_handoff`), which load it instead of parsing the file again.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from typing import Any

from torchgpu.data import ExampleData
from torchgpu.examples import housing
from torchgpu.stop_signals import STOP_SIGNALS
from torchgpu.train.config import TrainConfig
from torchgpu.train.task import Task

#: The launcher's hand-off to its workers: a file holding the data it already loaded.
HANDOFF_ENV = "TORCHGPU_DATA_HANDOFF"


def load(config: TrainConfig) -> ExampleData:
    """The CSV file's data (DataError for a bad file, exit 2): the launcher's hand-off
    when there is one for this file, target and seed, else parsed here.

    ``config.fixed_batch_size`` (none with ``--batch-size auto``): a CSV whose train
    split holds fewer rows than one batch is refused here.
    """
    from torchgpu.data import csv_data

    assert config.data is not None and config.target is not None
    handed = _handed_off(config)
    if handed is not None:
        return handed
    return csv_data(config.data, config.target, seed=config.seed,
                    batch_size=config.fixed_batch_size)


def task(config: TrainConfig) -> Task:
    """The plug-in: the CSV table, the housing net, MSE, R², Adam."""
    return housing.regression_task(config, load(config))


def _source_key(config: TrainConfig) -> dict[str, Any]:
    """What the handed-off data was made from: the CSV file as it was, target, seed."""
    assert config.data is not None
    stat = os.stat(config.data)
    return {"path": os.path.abspath(config.data), "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns, "target": config.target, "seed": config.seed}


def _handed_off(config: TrainConfig) -> ExampleData | None:
    """The data the launcher wrote for this run (see :func:`data_handoff`), or None when
    there is none, or it was made from another file, version, target or seed."""
    from torchgpu.data.handoff import load_example

    path = os.environ.get(HANDOFF_ENV)
    if not path or config.data is None or not os.path.isfile(config.data):
        return None
    return load_example(path, expected_key=_source_key(config))


@contextlib.contextmanager
def data_handoff(config: TrainConfig, data: ExampleData | None) -> Iterator[None]:
    """While relaunching under torchrun: the launcher's CSV data, already parsed, split
    and standardised, written once to a temporary file that every worker on this node
    loads instead of parsing the CSV again (``HANDOFF_ENV`` names it; the workers
    inherit the variable). Removed, and the variable restored, on exit. Built-in
    examples are generated in milliseconds and need none."""
    if config.data is None or config.target is None or data is None:
        yield
        return
    from torchgpu.data.handoff import save_example

    previous = os.environ.get(HANDOFF_ENV)
    # A stop signal raises where it lands: held while the directory is made (so that it
    # exists only inside the try that removes it) and while it is removed.
    mask = _hold_stops()
    tmp: str | None = None
    try:
        tmp = tempfile.mkdtemp(prefix="torchgpu-data-")
        _release(mask)  # a stop that came meanwhile lands here, inside the try
        path = os.path.join(tmp, "data.npz")
        save_example(data, path, key=_source_key(config))
        del data  # the caller drops its copy too while the workers run
        os.environ[HANDOFF_ENV] = path
        yield
    finally:
        _hold_stops()
        try:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            if previous is None:
                os.environ.pop(HANDOFF_ENV, None)
            else:
                os.environ[HANDOFF_ENV] = previous
        finally:
            _release(mask)


def _hold_stops() -> set[int] | None:
    """Block the stop signals (delivered when released); the mask before, or None where
    signals cannot be blocked."""
    if not hasattr(signal, "pthread_sigmask"):
        return None
    return set(signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS)))


def _release(mask: set[int] | None) -> None:
    if mask is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
