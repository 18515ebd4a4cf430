"""Who am I in a multi-process run, and the process group that joins us.

torchrun (``torch.distributed.run``) starts one process per device and tells each one
its place through environment variables: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and
``LOCAL_WORLD_SIZE``. :class:`DistEnv` reads them; :func:`init_distributed` binds the
process to its GPU and forms the process group; the agreement helpers let every rank
take the same decision (stop, skip, shrink a batch) without deadlocking
(:mod:`torchgpu.collectives`).

Without torchrun (``WORLD_SIZE`` unset) everything works single-process: no process
group is created and the helpers are the identity.
"""

from __future__ import annotations

import atexit
import os
import socket
import time
from collections.abc import Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import timedelta
from types import TracebackType
from typing import Any, Protocol

import torch
import torch.distributed as dist

from torchgpu.devices.cuda_status import cuda_device_count
from torchgpu.errors import ConfigError, DistributedError, NoDeviceError
from torchgpu.rendezvous import GroupStopped, await_peers, form_watching

BACKENDS: tuple[str, ...] = ("auto", "nccl", "gloo", "mpi", "ucc", "xccl")
DEFAULT_TIMEOUT = timedelta(minutes=10)

_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
class _Kept:
    """The group :func:`init_distributed` formed with ``keep=True``: it lives until the
    process exits (destroyed then, by an ``atexit`` hook registered once)."""

    group: Any = None
    hooked = False


_kept = _Kept()


def _read_int(environ: Mapping[str, str], name: str, default: int | None) -> int:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        if default is None:
            raise ConfigError(
                f"{name} is not set but WORLD_SIZE={environ.get('WORLD_SIZE')!r} is: a "
                f"distributed run needs {', '.join(_VARS)}; launch with torchrun "
                "(torchgpu launch --nproc N SCRIPT) instead of setting them by hand."
            )
        return default
    try:
        return int(raw.strip())
    except ValueError:
        raise ConfigError(
            f"{name}={raw!r} is not an integer: torchrun sets {', '.join(_VARS)} to "
            "non-negative integers; unset the variable or launch with torchrun."
        ) from None


class RankInfo(Protocol):
    """What code that only needs to know its place reads from a :class:`DistEnv`
    (loaders, checkpoint writers); lets callers pass look-alikes in tests."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def is_distributed(self) -> bool: ...


@dataclass(frozen=True)
class DistEnv:
    """This process's place in a (possibly single-process) run.

    ``rank`` is global (0..world_size-1); ``local_rank`` is the index on this machine
    and the GPU index the process uses. ``is_main`` is rank 0 (the one that prints and
    writes); ``is_distributed`` is ``world_size > 1``.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        """Read torchrun's variables (default ``os.environ``).

        ``WORLD_SIZE`` unset means a single process: ``DistEnv(0, 0, 1, 1)``. When it is
        set, ``RANK`` is required; a missing ``LOCAL_RANK`` defaults to ``RANK`` and a
        missing ``LOCAL_WORLD_SIZE`` to ``WORLD_SIZE`` (one machine). Non-integers and
        out-of-range values raise ConfigError naming the variable.
        """
        env = os.environ if environ is None else environ
        if env.get("WORLD_SIZE") is None or env.get("WORLD_SIZE", "").strip() == "":
            return cls()
        world = _read_int(env, "WORLD_SIZE", None)
        rank = _read_int(env, "RANK", None)
        local_world = _read_int(env, "LOCAL_WORLD_SIZE", world)
        local_rank = _read_int(env, "LOCAL_RANK", rank)
        problems = []
        if world < 1:
            problems.append(f"WORLD_SIZE={world} must be >= 1")
        if not 0 <= rank < max(world, 1):
            problems.append(f"RANK={rank} must be in 0..{world - 1}")
        if not 1 <= local_world <= max(world, 1):
            problems.append(f"LOCAL_WORLD_SIZE={local_world} must be in 1..WORLD_SIZE={world}")
        if not 0 <= local_rank < max(local_world, 1):
            problems.append(f"LOCAL_RANK={local_rank} must be in 0..{local_world - 1}")
        if problems:
            raise ConfigError(
                "bad distributed environment: " + "; ".join(problems) + ". These variables "
                "are set by torchrun; launch with torchgpu launch / torchrun, or unset "
                "WORLD_SIZE to run a single process."
            )
        return cls(rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world)


@dataclass(frozen=True)
class DistSession(DistEnv):
    """What :func:`init_distributed` returns: a :class:`DistEnv` that also owns the group.

    Use it as a value (``env = init_distributed()``; call ``env.close()`` or
    ``destroy_process_group()`` yourself at the end) or as a context manager
    (``with init_distributed() as env:``; the group is destroyed on exit, also on error).
    ``backend`` is the backend in use (``None`` when no group was formed);
    ``owns_group`` is False when the group existed before the call (then ``close``
    leaves it alone). ``env`` is the plain :class:`DistEnv`.
    """

    backend: str | None = field(default=None, compare=False)
    owns_group: bool = field(default=False, compare=False)
    kept: bool = field(default=False, compare=False)  # the process keeps the group (keep=True)

    @property
    def env(self) -> DistEnv:
        return DistEnv(self.rank, self.local_rank, self.world_size, self.local_world_size)

    def close(self, clean: bool = True) -> None:
        """Destroy the process group if this call created it (idempotent).

        ``clean=True`` (a normal exit) first collects garbage and waits at a barrier:
        gloo aborts the process ("terminate called without an active exception") when
        a rank tears its group down while DDP buffers or a peer's last collective are
        still in flight. After an error the barrier is skipped, since the peers may be
        gone and waiting for them would hang until the group's timeout.

        A group kept for the process's life (``keep=True``) is only waited on at the
        barrier after a clean exit, and stays for the next session; after an error it is
        destroyed (a peer may be gone: it cannot be used again).
        """
        if not (self.owns_group and dist.is_available() and dist.is_initialized()):
            return
        if clean and self.world_size > 1:
            import gc

            gc.collect()
            dist.barrier()
        if self.kept and clean:
            return
        if self.kept:
            _kept.group = None
        dist.destroy_process_group()

    def __enter__(self) -> DistSession:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
            return
        # A peer already gone can make the teardown fail: the script's own error (or exit
        # code) is the one to report.
        with suppress(Exception):
            self.close(clean=False)


def _resolve_backend(backend: str, device: torch.device | None) -> str:
    if not isinstance(backend, str) or backend.lower() not in BACKENDS:
        raise ConfigError(
            f"unknown distributed backend {backend!r}: use one of {', '.join(BACKENDS)} "
            "(auto = nccl on CUDA GPUs, gloo on CPU)."
        )
    backend = backend.lower()
    if backend != "auto":
        return backend
    wants_cuda = device.type == "cuda" if device is not None else torch.cuda.is_available()
    if wants_cuda and torch.cuda.is_available() and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def init_distributed(
    backend: str = "auto",
    timeout: timedelta = DEFAULT_TIMEOUT,
    device: torch.device | str | None = None,
    stop: Callable[[], bool] | None = None,
    startup_timeout: timedelta | None = None,
    keep: bool = False,
) -> DistSession:
    """Form the process group from torchrun's variables and bind this process to its GPU.

    - Not under torchrun (``WORLD_SIZE`` unset): returns a single-process session, no group.
    - ``backend="auto"``: NCCL when this process trains on CUDA (``device`` given as a cuda
      device, or CUDA available and ``device`` None), else gloo. ``device="cpu"`` forces
      gloo on a GPU machine.
    - With NCCL, ``torch.cuda.set_device(LOCAL_RANK)`` runs *before* the group is formed
      and before anything else touches CUDA, so rank k uses GPU k (not all on GPU 0).
    - A group that already exists is reused (and not destroyed by ``close``).
    - ``timeout``: how long a collective may wait for the other ranks. ``startup_timeout``
      (default ``timeout``): how long forming the group may wait for them (a peer still
      building its model): the wait for the peers after connecting to the store gets
      what is left of it, so the two waits add up to it (torch's own connection
      retries can still take a rank that finds no store up to ~2.5x it); the group
      then waits ``timeout`` in its collectives.
    - ``keep``: the group is the process's, not the session's: ``close`` leaves it
      (after a clean exit) for the next ``keep`` session, which reuses it with its own
      ``timeout``; it is destroyed when the process exits. Forming a group a second
      time in one process is unreliable under torchrun (the new group meets the old
      one's keys in the agent's store), so a script that trains several times forms
      it once.

    - ``stop``: asked every few tens of milliseconds while this process waits for its
      peers (a peer still starting, or stopped before it got here): when it answers
      True before the group has formed, :class:`~torchgpu.rendezvous.GroupStopped` is
      raised instead of waiting on (up to ``timeout``) for peers that are not coming. The group then
      does not exist, and a thread of this process may still wait in torch's rendezvous:
      end the process (``os._exit``) rather than go on.

    Returns a :class:`DistSession` (a DistEnv usable as a context manager).
    Raises ConfigError for bad variables/backend, NoDeviceError when NCCL is asked for
    without enough GPUs, DistributedError when the group cannot be formed.
    """
    env = DistEnv.from_env()
    dev = torch.device(device) if device is not None else None
    if os.environ.get("WORLD_SIZE") in (None, ""):
        return DistSession(0, 0, 1, 1, backend=None, owns_group=False)
    if not dist.is_available():
        raise DistributedError(
            "WORLD_SIZE is set but this torch build has no torch.distributed: install a "
            "torch build with distributed support, or unset WORLD_SIZE."
        )
    chosen = _resolve_backend(backend, dev)
    if chosen == "nccl":
        _bind_cuda_device(env)
    if dist.is_initialized():
        group = dist.distributed_c10d._get_default_group()
        if keep and group is _kept.group and str(dist.get_backend()) == chosen:
            _set_timeout(timeout)  # this session's collectives wait its own timeout
            return DistSession(env.rank, env.local_rank, env.world_size, env.local_world_size,
                               backend=chosen, owns_group=True, kept=True)
        if group is not _kept.group:
            return DistSession(
                env.rank, env.local_rank, env.world_size, env.local_world_size,
                backend=str(dist.get_backend()), owns_group=False,
            )
        _kept.group = None  # kept for another backend: formed again for this one
        dist.destroy_process_group()
    joining = startup_timeout if startup_timeout is not None else timeout

    def form() -> None:
        # The ranks first meet on the rendezvous store, waiting up to ``joining`` for a
        # peer still building its model; the group is then formed with ``timeout``, so
        # every operation of it (gloo's point-to-point sends too, which keep the timeout
        # the group was formed with) waits the collective timeout, not the start-up one.
        from torch.distributed.distributed_c10d import PrefixStore
        from torch.distributed.rendezvous import rendezvous

        began = time.monotonic()
        store, rank, world = next(rendezvous("env://", env.rank, env.world_size,
                                             timeout=joining))
        await_peers(store, world, joining, began=began)  # one start-up wait in all
        store.set_timeout(timeout)
        store = PrefixStore("default_pg", store)  # as init_process_group's own
        if chosen == "nccl":
            torch.cuda.set_device(env.local_rank)  # the current device is per thread
            # Binding the group to the device lets NCCL connect eagerly and stops barrier()
            # from guessing a device.
            dist.init_process_group(backend=chosen, store=store, rank=rank, world_size=world,
                                    timeout=timeout,
                                    device_id=torch.device("cuda", env.local_rank))
        else:
            dist.init_process_group(backend=chosen, store=store, rank=rank, world_size=world,
                                    timeout=timeout)

    try:
        form_watching(form, stop)
    except GroupStopped:
        raise
    except Exception as exc:
        raise DistributedError(
            f"could not form the {chosen} process group as rank {env.rank} of "
            f"{env.world_size} (MASTER_ADDR={os.environ.get('MASTER_ADDR')!r}, "
            f"MASTER_PORT={os.environ.get('MASTER_PORT')!r}): {exc}. Check that every rank "
            "was started by the same torchrun and can reach MASTER_ADDR:MASTER_PORT."
        ) from exc
    if keep:
        _kept.group = dist.distributed_c10d._get_default_group()
        if not _kept.hooked:
            _kept.hooked = True
            atexit.register(_destroy_kept)
    return DistSession(
        env.rank, env.local_rank, env.world_size, env.local_world_size,
        backend=chosen, owns_group=True, kept=keep,
    )


def _set_timeout(timeout: timedelta) -> None:
    """The default group's collectives wait ``timeout`` from now on (torch's
    ``_set_pg_timeout``; a torch without it keeps the timeout the group was formed with)."""
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is not None:
        setter(timeout)


def _destroy_kept() -> None:
    """At exit: destroy the group kept for the process's life, if it is still there."""
    if _kept.group is not None and dist.is_available() and dist.is_initialized() \
            and dist.distributed_c10d._get_default_group() is _kept.group:
        _kept.group = None
        dist.destroy_process_group()


def _bind_cuda_device(env: DistEnv) -> None:
    if not torch.cuda.is_available():
        raise NoDeviceError(
            "the nccl backend needs CUDA GPUs and none is usable: use backend='gloo' "
            "(or --device cpu) to run on CPU."
        )
    count = cuda_device_count()
    if env.local_rank >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise NoDeviceError(
            f"LOCAL_RANK={env.local_rank} needs GPU cuda:{env.local_rank} but {count} GPU(s) "
            f"are visible (CUDA_VISIBLE_DEVICES={visible!r}): start at most {count} "
            "processes per node (--nproc), or make more GPUs visible."
        )
    torch.cuda.set_device(env.local_rank)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (for MASTER_PORT / rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
