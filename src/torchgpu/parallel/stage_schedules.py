"""The schedules a multi-process pipeline runs and their rules, checked up front
(:func:`check_schedule`): 1F1B needs ``chunks >= stages`` (every stage must have a
micro-batch in flight before the first backward); interleaved 1F1B holds
``stages_per_rank`` stages per rank (rank ``r`` gets stages ``r, r + P, r + 2P, ...``,
:func:`stage_indices`) and needs ``chunks`` to be a multiple of the number of ranks P."""

from __future__ import annotations

from torchgpu.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")


def check_schedule(schedule: str, chunks: int, num_ranks: int, stages_per_rank: int = 1) -> None:
    """Raise ConfigError if ``schedule`` cannot run ``chunks`` micro-batches on
    ``num_ranks`` ranks with ``stages_per_rank`` stages each."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule {schedule!r} is not known: use one of {', '.join(SCHEDULES)}")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ConfigError(f"chunks={chunks!r} must be a positive integer (micro-batches per step)")
    if stages_per_rank < 1 or (schedule != "interleaved1f1b" and stages_per_rank != 1):
        raise ConfigError(
            f"stages_per_rank={stages_per_rank} needs schedule='interleaved1f1b' (and >= 1); "
            "gpipe and 1f1b run exactly one stage per rank"
        )
    stages = num_ranks * stages_per_rank
    if schedule == "1f1b" and chunks < stages:
        raise ConfigError(
            f"1F1B needs at least as many micro-batches as stages, got chunks={chunks} for "
            f"{stages} "
            f"stages: every stage must hold a micro-batch before the first backward; use "
            f"chunks>={stages} or schedule='gpipe'"
        )
    if schedule == "interleaved1f1b" and chunks % num_ranks != 0:
        raise ConfigError(
            f"interleaved 1F1B needs chunks to be a multiple of the {num_ranks} ranks, got "
            f"chunks={chunks}: "
            f"use chunks={max(num_ranks, chunks - chunks % num_ranks)} or "
            f"{chunks + num_ranks - chunks % num_ranks}"
        )


def stage_indices(rank: int, world_size: int, stages_per_rank: int = 1) -> list[int]:
    """The stages rank ``rank`` runs: ``rank, rank + P, ...`` (looped placement)."""
    return [rank + k * world_size for k in range(stages_per_rank)]
