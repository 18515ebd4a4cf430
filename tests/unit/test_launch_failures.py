"""The launcher names every failed rank: a killed rank takes its peers down in the next
collective, and which failure torchrun noticed first is a race."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from torchgpu import launcher


def test_every_failed_rank_is_named_with_its_signal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    failures = {
        0: ProcessFailure(local_rank=0, pid=11, exitcode=-6, error_file="/nonexistent"),
        1: ProcessFailure(local_rank=1, pid=12, exitcode=-9, error_file="/nonexistent"),
    }

    def torchrun(args: object) -> None:
        raise ChildFailedError("train.py", failures)

    monkeypatch.setattr("torch.distributed.run.run", torchrun)
    spec = launcher.LaunchSpec(nproc=2)
    assert launcher.run(spec, "train.py", []) == 1  # killed by signals: no exit code of its own
    err = capsys.readouterr().err
    assert "worker rank 0 of train.py failed (signal 6)" in err
    assert "worker rank 1 of train.py failed (signal 9)" in err
    assert err.count("worker rank") == 2


def test_an_exit_code_is_passed_on(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    failure = ProcessFailure(local_rank=1, pid=12, exitcode=3, error_file="/nonexistent")

    def torchrun(args: object) -> None:
        raise ChildFailedError("train.py", {1: failure})

    monkeypatch.setattr("torch.distributed.run.run", torchrun)
    assert launcher.run(launcher.LaunchSpec(nproc=2), "train.py", []) == 3
    assert "worker rank 1 of train.py failed (exit code 3)" in capsys.readouterr().err
