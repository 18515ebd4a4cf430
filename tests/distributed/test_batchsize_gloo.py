"""Batch-size search and OOM back-off on two gloo ranks with different memory limits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.procs import run_torchrun

WORKER = Path(__file__).with_name("batchsize_worker.py")


@pytest.mark.slow
def test_two_ranks_agree_on_the_smaller_limit() -> None:
    bytes_per_sample = 1000
    limits = [100_000, 37_000]  # rank 0 fits 100 samples, rank 1 fits 37
    proc = run_torchrun(WORKER, 2, [",".join(map(str, limits)), str(bytes_per_sample)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in rows) == [0, 1]
    expected = min(limits) // bytes_per_sample
    for row in rows:
        assert row["size"] == expected
        # rank 0 alone would have found 100: its probes above 37 failed by agreement
        assert [size for size, fits in row["probes"] if fits and size > expected] == []
        assert row["backoff"] == [[16, 2], [8, 4]]
    assert rows[0]["probes"] == rows[1]["probes"]
