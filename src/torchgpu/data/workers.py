"""DataLoader worker processes for one training process: ``--num-workers auto``.

:func:`auto_choice` is the rule, a pure function of the cores this process may use, the
processes sharing them and the device; :func:`worker_choice` applies it (or takes a
number as given) with this machine's cores and training processes.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

#: ``--num-workers auto``'s value (the default): chosen per run by :func:`auto_choice`.
AUTO = "auto"
#: Workers ``auto`` starts per training process at most: more only hold more copies of
#: the dataset and more batches in flight. 8 was too few on an H200 (16 cores, one
#: process): JPEG decode + crop of 160px images kept ResNet-50 bf16 waiting 19 % of its
#: step time (benchmarks/results/h200-sxm-141gb, train-data-wait); a process's share of a
#: 16-core machine, but one, is 15.
MAX_AUTO_WORKERS = 16
#: Workers hand batches over in shared memory (``/dev/shm``); below this much of it
#: (Docker's default is 64 MiB) a few batches in flight fail the run with a bus error, so
#: ``auto`` loads in the training process instead (a number given is used as given).
MIN_AUTO_SHM_BYTES = 1 << 30


@dataclass(frozen=True)
class WorkerChoice:
    """What a training DataLoader is built with (its keyword arguments of these names).

    ``prefetch_factor`` is None with 0 workers (DataLoader refuses one then) and where
    torch's default (2) is kept."""

    num_workers: int
    pin_memory: bool
    prefetch_factor: int | None
    persistent_workers: bool

    def loader_kwargs(self) -> dict[str, Any]:
        """The DataLoader keyword arguments."""
        kwargs: dict[str, Any] = {"num_workers": self.num_workers,
                                  "pin_memory": self.pin_memory}
        if self.num_workers > 0:
            kwargs["persistent_workers"] = self.persistent_workers
            if self.prefetch_factor is not None:
                kwargs["prefetch_factor"] = self.prefetch_factor
        return kwargs

    def as_dict(self) -> dict[str, Any]:
        return {"num_workers": self.num_workers, "pin_memory": self.pin_memory,
                "prefetch_factor": self.prefetch_factor,
                "persistent_workers": self.persistent_workers}


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask: a container's or
    ``taskset``'s limit), else every core of the machine."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def local_processes(env: Any = None) -> int:
    """Training processes on this machine: torchrun's ``LOCAL_WORLD_SIZE``, else 1."""
    value = str((os.environ if env is None else env).get("LOCAL_WORLD_SIZE", ""))
    return int(value) if value.isdigit() and int(value) > 0 else 1


def shared_memory_bytes() -> int | None:
    """The room in ``/dev/shm`` (None where there is no such file system)."""
    try:
        stat = os.statvfs("/dev/shm")
    except (AttributeError, OSError):
        return None
    return int(stat.f_bavail) * int(stat.f_frsize)


def auto_choice(cores: int, processes: int, device_type: str, *, in_memory: bool = False,
                shm_bytes: int | None = None) -> WorkerChoice:
    """``--num-workers auto`` for one of ``processes`` training processes that share
    ``cores`` CPU cores (:func:`available_cores`, :func:`local_processes`), on a
    ``device_type`` device, with ``shm_bytes`` of shared memory free
    (:func:`shared_memory_bytes`; None: not known, not limiting).

    - CUDA: one worker per core of the process's share but one (the main process feeds
      the GPU and runs the step), at most :data:`MAX_AUTO_WORKERS`; batches pinned (the
      copy to the GPU is then asynchronous). With 1 or 2 workers each prefetches 4
      batches, so a slow sample does not stall the step; with more, torch's 2 each
      already queue enough.
    - CPU (and other devices): 0. A CPU run's compute already uses every core of the
      process (torch's intra-op threads); a worker takes its time from them, which slows
      the common case, in-memory data, for nothing. A dataset that does real work per
      item shows it in the run's data-wait share, whose warning names ``--num-workers
      N`` as the fix.
    - ``in_memory`` (a plain TensorDataset, read a whole batch per indexing): 0 on any
      device, as a worker would only add a copy of each batch between processes.
    - less shared memory than :data:`MIN_AUTO_SHM_BYTES`: 0.

    Workers are never persistent: each epoch starts them afresh, seeded from the epoch's
    generator, which keeps a resumed run exact (a persistent worker carries its random
    state from epoch to epoch, and a resumed run cannot recreate it); that costs a
    fork per worker per epoch, which the training run hides by starting the next epoch's
    iterator while an epoch's last batches train
    (:func:`torchgpu.train.loop.epoch.loads_ahead`).
    """
    pin = device_type == "cuda"
    workers = 0
    small_shm = shm_bytes is not None and shm_bytes < MIN_AUTO_SHM_BYTES
    if device_type == "cuda" and not in_memory and not small_shm:
        share = max(1, cores // max(processes, 1))
        workers = max(0, min(share - 1, MAX_AUTO_WORKERS))
    prefetch = (4 if workers <= 2 else 2) if workers else None
    return WorkerChoice(workers, pin, prefetch, persistent_workers=False)


def worker_choice(num_workers: int | str, device_type: str, *, in_memory: bool = False
                  ) -> WorkerChoice:
    """The workers of a training loader: ``num_workers`` as given (an int; torch's
    prefetching), or ``"auto"``'s :func:`auto_choice` with this process's cores."""
    if num_workers == AUTO:
        return auto_choice(available_cores(), local_processes(), device_type,
                           in_memory=in_memory,
                           shm_bytes=shared_memory_bytes() if device_type == "cuda" else None)
    if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 0:
        from torchgpu.errors import ConfigError

        raise ConfigError(
            f"num_workers={num_workers!r} is not allowed: pass a number of DataLoader "
            "worker processes (0 loads in the training process) or 'auto'.")
    return WorkerChoice(num_workers, device_type == "cuda", None, persistent_workers=False)


def loader_summary(loader: Any, setting: int | str) -> dict[str, Any]:
    """``summary.json``'s ``data_loader``: how the training DataLoader ``loader`` loads
    (its resolved ``num_workers``, ``pin_memory``, ``prefetch_factor``,
    ``persistent_workers``) and ``num_workers_setting``, the setting as given (``"auto"``
    or a number; ``config.toml`` keeps it, so a replay decides again)."""
    workers = int(loader.num_workers)
    return {"num_workers": workers, "num_workers_setting": setting,
            "pin_memory": bool(loader.pin_memory),
            "prefetch_factor": loader.prefetch_factor if workers else None,
            "persistent_workers": bool(loader.persistent_workers)}


@contextlib.contextmanager
def forking() -> Iterator[None]:
    """Around ``iter(loader)``, which forks a DataLoader's workers: the garbage
    collector's objects are frozen (:func:`gc.freeze`) while they fork, so a worker's
    collector never finalizes what was already garbage here. An object that holds a C++
    thread (a process group's or a store's, left by an earlier run in a long-lived
    process), destroyed in a forked child, aborts it: "DataLoader worker exited
    unexpectedly". Unfrozen in this process right after; left alone when something else
    froze objects already (its freeze is not ours to undo)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
