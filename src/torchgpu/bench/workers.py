"""Benchmark variants that live in a process group (DDP, multi-process pipelines).

A :class:`WorkerGroup` spawns ``world_size`` processes on 127.0.0.1 that form a process
group (gloo on CPU, NCCL on GPUs) with :func:`torchgpu.init_distributed`, build their
share of the work once, then wait. Entering the group only starts the processes; the
first sample waits for them to be ready, so a suite can build its in-process variants
while the workers import torch. Each :meth:`WorkerGroup.run_once` is one timed sample:
every rank passes a barrier, runs its step, synchronises its GPU, passes a second
barrier; rank 0's elapsed time between the barriers is the sample. Because the workers
wait between samples, the parent can interleave them round by round with in-process
variants (:func:`~torchgpu.bench.timer.measure_interleaved` accepts the returned seconds).

The work is named by ``"module:function"``; the function is called in each worker as
``function(rank, world_size, device, spec) -> (step, stats)`` where ``step()`` runs one
sample's work and ``stats()`` returns a JSON-safe dict (e.g. peak memory) on request.

No worker outlives the parent: :meth:`WorkerGroup.close` (on leaving the ``with``, also
on an exception, KeyboardInterrupt or the SIGTERM ``torchgpu bench`` turns into one)
stops them, terminating at once when leaving on an exception; and a worker exits by
itself within :data:`_POLL_S` when the parent is gone (killed with SIGKILL, say), in
whatever phase it is, which also lets the fork server, kept alive by its children, exit.
A stop signal while workers start is held until each has read its arguments (the
queues, whose semaphores the parent unlinks when it exits).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
import torch.multiprocessing as mp
from torch.multiprocessing import parent_process

from torchgpu.stop_signals import STOP_SIGNALS, routed_to

if TYPE_CHECKING:
    from multiprocessing.context import ForkServerContext, SpawnContext
    from multiprocessing.process import BaseProcess
    from multiprocessing.queues import Queue

Step = Callable[[], None]
Stats = Callable[[], dict[str, Any]]

_POLL_S = 0.2


def _context() -> ForkServerContext | SpawnContext:
    """Start method for workers: forkserver where the platform has it, else spawn.

    Both are safe with CUDA and with OpenMP threads in the parent (plain fork is not: a
    child forked after the parent ran a multi-threaded OpenMP region can hang). The fork
    server imports torch once (preloaded) and forks each worker from that state, so a
    group of N workers pays one torch import instead of N.
    """
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torchgpu.bench.workers"])
        return ctx
    return mp.get_context("spawn")


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT/SIGTERM (delivered on leaving) while workers start: raised between a
    worker's fork and its record in the group, they would leave a worker that
    :meth:`WorkerGroup.close` does not know, which then fails to unpickle its queues once
    this process is gone (a traceback from the fork server). Blocking the signals in this
    thread is not enough: the queues' feeder threads do not block them, the kernel hands
    the signal to one of those, and Python runs the handler in this thread at once. So
    the handlers themselves are replaced by one that records, and what arrived is raised
    again on leaving. (The mask stays for spawned children, which unblock first thing.)"""
    arrived: list[int] = []

    def record(signum: int, frame: object) -> None:
        arrived.append(signum)

    try:
        with routed_to(record) as installed:
            mask = (signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))
                    if installed and hasattr(signal, "pthread_sigmask") else None)
            try:
                yield
            finally:
                if mask is not None:
                    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    finally:  # the handlers are restored: each arrived signal once, in arrival order
        for signum in dict.fromkeys(arrived):
            signal.raise_signal(signum)


def _resolve(factory: str) -> Callable[..., tuple[Step, Stats]]:
    module_name, _, function = factory.partition(":")
    fn: Callable[..., tuple[Step, Stats]] = getattr(importlib.import_module(module_name),
                                                    function)
    return fn


def _exit_with_parent() -> None:
    """End this worker (at once, whatever it is doing: forming the group, building its
    work, waiting) when the process that started it is gone, e.g. killed with SIGKILL,
    which runs no code to close the group: a watcher thread polls it every
    :data:`_POLL_S`. Nothing of the worker's needs saving; its parent reads the results."""
    parent = parent_process()
    if parent is None:  # run in the parent itself
        return

    def watch() -> None:
        while parent.is_alive():
            time.sleep(_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="torchgpu-bench-parent", daemon=True).start()


def _worker(
    rank: int, world_size: int, port: int, factory: str, device: str, spec: dict[str, Any],
    threads: int, commands: Queue[str], results: Queue[tuple[str, int, Any]],
) -> None:
    """Body of one worker process (module level so the start method can pickle it)."""
    # First: this process has unpickled its queues (their semaphores are open), so the
    # parent may now take a stop signal and exit, which unlinks them (WorkerGroup.launch).
    results.put(("started", rank, None))
    if hasattr(signal, "pthread_sigmask"):  # a spawned child inherits the launch's mask
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    _exit_with_parent()
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(threads)
    try:
        import torch.distributed as dist

        from torchgpu.distributed import init_distributed

        target = torch.device(device)
        backend = "nccl" if target.type == "cuda" else "gloo"
        with init_distributed(backend=backend, device=target):
            step, stats = _resolve(factory)(rank, world_size, target, spec)
            results.put(("ready", rank, None))
            parent = parent_process()  # None only when run in the parent itself
            while True:
                try:
                    command = commands.get(timeout=_POLL_S)
                except queue.Empty:
                    if parent is not None and not parent.is_alive():
                        break  # the parent died without closing the group: do not linger
                    continue
                if command == "run":
                    dist.barrier()
                    start = time.perf_counter()
                    step()
                    if target.type == "cuda":
                        torch.cuda.synchronize(target)
                    dist.barrier()
                    if rank == 0:
                        results.put(("time", rank, time.perf_counter() - start))
                elif command == "stats":
                    results.put(("stats", rank, stats()))
                else:
                    break
            # Free the work (DDP reducers hold the group) before the group is destroyed.
            del step, stats
            gc.collect()
    except BaseException as error:
        results.put(("error", rank, f"{type(error).__name__}: {error}"))
        raise
    # The group is gone and every reply is flushed: skip the interpreter's teardown of
    # torch (seconds on a loaded machine, paid once per worker per suite).
    results.close()
    results.join_thread()
    os._exit(0)


class WorkerGroup:
    """``world_size`` worker processes running ``factory``'s step on demand.

    ``devices[r]`` is rank r's device (``"cpu"`` or ``"cuda:r"``); ``threads`` is torch's
    intra-op thread count in each worker. Every wait is bounded by ``timeout_s``; a worker
    that fails or dies raises RuntimeError with its message. Use as a context manager so the
    processes are always stopped.
    """

    def __init__(self, factory: str, devices: list[str], spec: dict[str, Any],
                 threads: int = 1, timeout_s: float = 300.0) -> None:
        self.factory, self.devices, self.spec = factory, list(devices), dict(spec)
        self.world_size = len(self.devices)
        self.threads, self.timeout_s = threads, timeout_s
        self._ctx = _context()
        self._results: Queue[tuple[str, int, Any]] = self._ctx.Queue()  # (kind, rank, value)
        self._commands: list[Queue[str]] = []
        self._procs: list[BaseProcess] = []
        self._ready = False
        self._early: list[tuple[str, int, Any]] = []  # replies read while workers started

    def __enter__(self) -> WorkerGroup:
        try:
            self.launch()
        except BaseException:  # a stop signal held while they started: end them now
            self.close(force=True)
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        # Leaving on an exception (a failure, Ctrl-C, SIGTERM): no polite "stop" through
        # the queues, whose locks the interrupted code may hold; terminate at once.
        self.close(force=exc_type is not None)

    def start(self) -> None:
        """Start the processes and wait until every rank has built its work."""
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the processes without waiting until they are ready (see
        :meth:`wait_ready`): only until each has started (:meth:`_wait_started`)."""
        from torchgpu.distributed import free_port

        self._ready = False
        port = free_port()
        if self._ctx.get_start_method() == "forkserver":
            from multiprocessing import forkserver

            # Started now, not inside _signals_held: a process inherits the signal mask.
            forkserver.ensure_running()
        with _signals_held():
            for rank, device in enumerate(self.devices):
                commands = self._ctx.Queue()
                proc = self._ctx.Process(
                    target=_worker, daemon=True,
                    args=(rank, self.world_size, port, self.factory, device, self.spec,
                          self.threads, commands, self._results),
                )
                proc.start()
                self._commands.append(commands)
                self._procs.append(proc)
            self._wait_started()

    def _wait_started(self) -> None:
        """Until every worker said it started (bounded; a worker that died is left to
        :meth:`_collect` to report): a started process has not yet read its arguments,
        the queues, whose semaphores this process unlinks when it exits, and a stop
        signal now would have it fail to open them (a fork server's traceback)."""
        started: set[int] = set()
        deadline = time.monotonic() + self.timeout_s
        while len(started) < len(self._procs) and time.monotonic() < deadline:
            try:
                message, rank, value = self._results.get(timeout=_POLL_S)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in self._procs):
                    return
                continue
            if message == "started":
                started.add(rank)
            else:
                self._early.append((message, rank, value))

    def wait_ready(self) -> None:
        """Block until every rank reported ready (once; later calls return at once)."""
        if self._ready:
            return
        ready = self._collect("ready", self.world_size)
        if len(ready) != self.world_size:
            raise RuntimeError(f"only {len(ready)} of {self.world_size} workers started")
        self._ready = True

    def run_once(self) -> float:
        """One timed sample: rank 0's seconds between the barriers around every rank's step."""
        self.wait_ready()
        for commands in self._commands:
            commands.put("run")
        ((_, seconds),) = self._collect("time", 1)
        return float(seconds)

    def stats(self) -> list[dict[str, Any]]:
        """Every rank's ``stats()``, in rank order."""
        self.wait_ready()
        for commands in self._commands:
            commands.put("stats")
        return [value for _, value in sorted(self._collect("stats", self.world_size),
                                             key=lambda item: int(item[0]))]

    def _collect(self, kind: str, count: int) -> list[tuple[int, Any]]:
        deadline = time.monotonic() + self.timeout_s
        got: list[tuple[int, Any]] = []
        while len(got) < count:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"benchmark workers ({self.factory}) gave no {kind!r} within "
                    f"{self.timeout_s:.0f} s"
                )
            try:
                message, rank, value = (self._early.pop(0) if self._early else
                                        self._results.get(timeout=_POLL_S))
            except queue.Empty:
                dead = [p.exitcode for p in self._procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(
                        f"a benchmark worker ({self.factory}) exited with code {dead[0]}"
                    ) from None
                continue
            if message == "error":
                raise RuntimeError(f"benchmark worker rank {rank} failed: {value}")
            if message == kind:
                got.append((rank, value))
        return got

    def close(self, force: bool = False) -> None:
        """Ask every worker to stop; terminate any still running after a grace period,
        then kill any still running after another (``force``: terminate at once). Every
        wait is bounded: no worker is left running when this returns."""
        if not force:
            for commands in self._commands:
                with contextlib.suppress(OSError, ValueError):
                    commands.put("stop")
        for proc in self._procs:
            if not force:
                proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._procs.clear()
        self._commands.clear()
