"""The launcher names every failed rank: a killed rank takes its peers down in the next
collective, and which failure torchrun noticed first is a race."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from torchgpu.launch import run as launcher


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


def test_what_torchruns_teardown_caused_is_no_stop(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """StopJudge: a stop record written, or a SIGTERM death, after torchrun's agent began
    tearing the round down (it SIGTERMs the survivors of a failed worker) is the
    teardown's, not a stop; the record is removed before a restart. What came before
    the teardown, or the launcher's own signal, is a stop."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from torchgpu.launch.stop import StopForwarder, StopJudge
    from torchgpu.launch.stop_record import STOP_FILE_ENV, record_stop, recorded_stop

    record = Path(str(tmp_path)) / "stop.json"
    monkeypatch.setenv(STOP_FILE_ENV, str(record))
    survivor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        judge = StopJudge(StopForwarder(5.0, children=list))
        judge.new_round()
        crashed = ProcessFailure(local_rank=0, pid=1, exitcode=-9, error_file="/nonexistent")
        judge.teardown([crashed.pid, survivor.pid])  # the agent is about to SIGTERM rank 1
        record_stop("SIGTERM", 1)  # ... which rank 1 records, and dies of
        torn = ProcessFailure(local_rank=1, pid=survivor.pid, exitcode=-15,
                              error_file="/nonexistent")
        result = type("Result", (), {"failures": {0: crashed, 1: torn}})()
        assert not judge.stopped(result) and judge.signal(result.failures) is None
        assert judge.recorded() is None
        judge.new_round()  # torchrun restarts: the teardown's record goes
        assert recorded_stop() is None
        # the next round: a SIGTERM a worker recorded before the teardown is a stop
        record_stop("SIGTERM", 1)
        judge.teardown([survivor.pid])
        assert judge.stopped(result) and judge.recorded() == "SIGTERM on rank 1"
        judge.new_round()
        assert recorded_stop() == "SIGTERM on rank 1"  # a stop's record stays
        # a worker killed by SIGTERM that the teardown did not signal is a stop too
        record.unlink()
        judge.new_round()
        judge.teardown([])
        assert judge.signal({1: torn}) == signal.SIGTERM
    finally:
        survivor.kill()
        survivor.wait()
