"""Workers of `torchgpu train --nproc 2` leave as soon as everything is written: the
interpreter's teardown of torch (garbage collection, finalizers: seconds on a loaded
machine, after a stop that must end within a bound) is skipped, and the run's files and
report are complete all the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.procs import SRC, run_cli
from torchgpu.checkpoint import verify_checkpoint

pytestmark = pytest.mark.slow

# Loaded by every Python process of the run (it is on PYTHONPATH): a process that goes
# through the interpreter's normal exit runs its atexit handlers and leaves a file.
SITECUSTOMIZE = """
import atexit, os
from pathlib import Path

def _finalized():
    Path(os.environ["EXIT_MARKS"], f"rank-{os.environ.get('RANK', 'launcher')}").write_text("")

atexit.register(_finalized)
"""


def test_workers_skip_the_interpreter_teardown_once_everything_is_written(
        tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    marks = tmp_path / "marks"
    marks.mkdir()
    out = tmp_path / "run"
    done = run_cli(["train", "--example", "housing", "--data-size", "100", "--batch-size", "8",
                    "--epochs", "3", "--save-every", "5", "--progress", "off", "--device",
                    "cpu", "--nproc", "2", "--strategy", "ddp", "--out", str(out)],
                   timeout=180, PYTHONPATH=f"{SRC}:{site}", EXIT_MARKS=str(marks))
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in marks.iterdir()) == ["rank-launcher"]  # no rank's teardown
    assert "trained housing" in done.stdout and "model:" in done.stdout  # the report, whole
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 15 and not summary["stopped_early"]
    assert (out / "model.safetensors").stat().st_size > 0
    verify_checkpoint(out / "checkpoints" / "step-00000015")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "step"] == list(range(1, 16))
    assert len([r for r in records if r["kind"] != "step"]) == 3  # one per epoch
