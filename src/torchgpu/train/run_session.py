"""A run's process group and its collectives' failures: :func:`process_group` forms the
group (waiting ``--startup-timeout`` for the other ranks, kept for the process's life),
and :func:`named_hangs` turns a collective that timed out or lost its peer into an error
naming this rank's position (the heartbeat records it for the launcher)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

from torchgpu.distributed import DistSession, init_distributed
from torchgpu.errors import (
    CollectiveTimeoutError,
    DistributedError,
    StartupTimeoutError,
    TorchGpuError,
    first_line,
)
from torchgpu.launch.heartbeat import Heartbeat, collective_failure
from torchgpu.launch.stop_record import StopFlag
from torchgpu.train.assemble import Assembly
from torchgpu.train.config import TrainConfig


@contextmanager
def process_group(run: Assembly, beat: Heartbeat | None,
                  stop: StopFlag | None) -> Iterator[DistSession]:
    """The run's process group (:func:`torchgpu.distributed.init_distributed`), kept for
    the process's life: a script that calls ``fit`` again reuses it. Forming it waits
    ``--startup-timeout`` for the other ranks (``--collective-timeout`` is for the
    collectives after it); a rank that waited that long fails with
    :class:`StartupTimeoutError`, recorded in its heartbeat (the launcher names the
    ranks that did not join and where they were)."""
    config = run.config
    if beat is not None:
        beat.phase, beat.timeout_s = "joining", config.startup_timeout
    try:
        session = init_distributed(device=run.device, timeout=collective_timeout(config),
                                   startup_timeout=timedelta(seconds=config.startup_timeout),
                                   stop=stop.requested if stop is not None else None,
                                   keep=True)
    except DistributedError as error:
        cause = error.__cause__
        if cause is None or collective_failure(cause) != "timeout":
            raise
        if beat is not None:
            beat.failed("timeout", cause)
        raise StartupTimeoutError(
            f"rank {run.env.rank} waited {config.startup_timeout:g} s for the other ranks to "
            f"form the process group at start-up and they did not all join "
            f"({first_line(cause)}); the launcher names the rank(s) that did not join and "
            "where each was. If building the model or loading the data legitimately takes "
            "longer, raise --startup-timeout."
        ) from error
    if beat is not None:
        beat.phase, beat.timeout_s = "setup", config.collective_timeout
    with session:
        yield session


def collective_timeout(config: TrainConfig) -> timedelta:
    """The process group's timeout: ``--collective-timeout`` seconds."""
    return timedelta(seconds=config.collective_timeout)


@contextmanager
def named_hangs(run: Assembly, beat: Heartbeat | None) -> Iterator[None]:
    """A collective that times out (or loses its peer) becomes CollectiveTimeoutError /
    DistributedError naming this rank's position; the heartbeat records it for the
    launcher, which names the rank(s) that did not arrive."""
    try:
        yield
    except TorchGpuError:
        raise
    except Exception as error:
        kind = collective_failure(error) if run.env.world_size > 1 or beat else None
        if kind is None:
            raise
        where = beat.where() if beat is not None else "a collective"
        if beat is not None:
            beat.failed(kind, error)
        rank = run.env.rank
        if kind == "timeout":
            raise CollectiveTimeoutError(
                f"rank {rank} waited {run.config.collective_timeout:g} s in {where} and "
                f"another rank never joined it ({first_line(error)}); the launcher names the "
                "rank(s) that did not arrive and where each was. If a step legitimately "
                "takes longer, raise --collective-timeout."
            ) from error
        raise DistributedError(
            f"rank {rank} lost a peer in {where} ({first_line(error)}): another rank "
            "ended; see its output for why."
        ) from error
