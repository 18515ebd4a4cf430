"""Two gloo ranks, DDP through run_epoch, where only rank 1 runs out of memory or sees a
NaN loss: both ranks back off (or skip, or stop) together, without hanging and without a
collective on every step; the periodic agreement stops both ranks at the same step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.procs import run_torchrun

WORKER = Path(__file__).with_name("train_oom_worker.py")

# One xdist worker for the module: the worker's torchrun (~13 s) runs once, not once on
# each worker that --dist loadgroup would spread the module's tests over.
pytestmark = pytest.mark.xdist_group("train-oom")


@pytest.fixture(scope="module")
def both_reads() -> list[dict[str, Any]]:
    """The worker's rows, rank 0's first: one torchrun runs every scenario in both
    loss-read modes."""
    proc = run_torchrun(WORKER, 2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in rows) == [0, 1]
    return sorted(rows, key=lambda r: int(r["rank"]))


@pytest.fixture(params=["micro-batch", "step"])
def reports(request: pytest.FixtureRequest,
            both_reads: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # "step": the loss read once per optimizer step, as on an accelerator
    # (torchgpu.train.loop.loss_reader); "micro-batch": as on the CPU.
    return [{"rank": row["rank"], **row[request.param]} for row in both_reads]


@pytest.mark.slow
def test_only_rank_1_runs_out_of_memory_and_both_back_off_together(
        reports: list[dict[str, Any]]) -> None:
    for row in reports:
        case = row["backoff_1x"]
        assert case["pairs"] == [[64, 1], [32, 2], [16, 4]]
        assert case["steps"] == 2
        assert case["same_weights_on_all_ranks"] and case["same_losses_on_all_ranks"]
        assert case["equal_to_reference"]  # = DDP started at 16 x 4
        assert case["losses_match_reference"]
        window = row["backoff_window"]  # 32 x 2: rank 1 fails in a no_sync micro-step
        assert window["pairs"] == [[32, 2], [16, 4], [8, 8]]
        assert window["equal_to_reference"] and window["same_weights_on_all_ranks"]
        # with dropout, the OOM after the mask was drawn: the replay draws the same masks
        for name, pairs in (("backoff_dropout", case["pairs"]),
                            ("backoff_dropout_window", window["pairs"])):
            dropout = row[name]
            assert dropout["pairs"] == pairs, name
            assert dropout["equal_to_reference"] and dropout["losses_match_reference"], name
            assert dropout["same_weights_on_all_ranks"], name


@pytest.mark.slow
def test_a_nan_on_rank_1_skips_or_stops_on_both_ranks(reports: list[dict[str, Any]]) -> None:
    for row in reports:
        skip = row["skip"]
        assert (skip["steps"], skip["skipped"]) == (7, 1)
        assert skip["finite"] and skip["same_weights_on_all_ranks"]
        assert skip["same_losses_on_all_ranks"]
        window = row["skip_window"]  # the NaN in the first half of window 2 drops it
        assert (window["steps"], window["skipped"]) == (3, 1)
        assert window["finite"] and window["same_weights_on_all_ranks"]
        stop = row["stop"]
        assert stop["steps"] == 2 and stop["weights_unchanged"] and stop["finite"]
        assert "step 3" in stop["error"]
    assert "non-finite loss on rank 1" in reports[1]["stop"]["error"]
    assert "another rank; this is rank 0" in reports[0]["stop"]["error"]


@pytest.mark.slow
def test_a_stop_flag_on_one_rank_stops_both_at_the_same_boundary(
        reports: list[dict[str, Any]]) -> None:
    for row in reports:
        case = row["stop_flag"]
        assert case["stopped"] and case["same_step_on_all_ranks"]
        assert 3 <= case["step"] < 32  # at the next agreement, not at the epoch end
        assert case["synced_equal"] and case["same_losses_on_all_ranks"]
