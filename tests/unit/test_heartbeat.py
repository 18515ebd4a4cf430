"""Heartbeats and the hang report, in one process: the file a rank keeps, the phases the
collectives mark, the paragraph the launcher prints, the watcher's kill and clean-up,
the error classification, and the flags and fault variables that drive them."""

from __future__ import annotations

import io
import json
import math
import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from torchgpu.errors import ConfigError
from torchgpu.launch import hang_watch as hw
from torchgpu.launch import heartbeat as hb
from torchgpu.train.hooks.faults import HangPlan, hang_plan_from_env


def _beat(tmp_path: Path, rank: int = 1, world: int = 2) -> hb.Heartbeat:
    return hb.Heartbeat(tmp_path, rank, world)


def test_the_file_holds_step_phase_and_last_line_and_survives_an_error(tmp_path: Path) -> None:
    beat = _beat(tmp_path)
    state = SimpleNamespace(step=0, epoch=0)
    with beat.running():
        beat.follow(state)
        beat.phase = "training"
        print("epoch 1 loss 0.5\r", "partial", sep="")
        state.step, state.epoch = 7, 1
        with beat.during("agreement"):
            record = json.loads(beat.path.read_text())
            assert record["phase"] == "agreement" and record["step"] == 7
        assert beat.phase == "training"  # restored after the block
        with pytest.raises(RuntimeError), beat.during("checkpoint"):
            raise RuntimeError("Timed out waiting 3000ms for recv operation to complete")
        assert beat.phase == "checkpoint"  # an error leaves the phase where it happened
        beat.failed("timeout", RuntimeError("[gloo/pair.cc:1] Timed out waiting 3000ms"))
    record = json.loads(beat.path.read_text())
    assert record["rank"] == 1 and record["world_size"] == 2 and record["pid"] == os.getpid()
    assert record["step"] == 7 and record["epoch"] == 1
    assert record["line"] == "partial"
    failure = record["failure"]
    assert failure["kind"] == "timeout" and failure["phase"] == "checkpoint"
    assert failure["error"] == "Timed out waiting 3000ms"  # gloo's source location dropped
    assert sys.stdout.__class__.__name__ != "_LastLine"  # streams put back


def test_a_stalled_rank_records_where_its_main_thread_is(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hb, "STALL_S", 0.0)
    beat = _beat(tmp_path)
    beat.write()
    stack = json.loads(beat.path.read_text())["stack"]
    assert stack and "test_heartbeat.py" in stack[0]


def test_the_writer_thread_follows_the_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    monkeypatch.setattr(hb, "TICK_S", 0.02)
    beat = _beat(tmp_path)
    state = SimpleNamespace(step=0, epoch=0)
    with beat.running():
        beat.follow(state)
        state.step = 5
        deadline = time.monotonic() + 5
        while json.loads(beat.path.read_text())["step"] != 5:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert json.loads(beat.path.read_text())["phase"] == "done"


def test_from_env_needs_the_directory_and_several_processes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(hb.HEARTBEAT_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    beat = hb.Heartbeat.from_env()
    assert beat is not None and beat.path == tmp_path / "rank1.json"
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert hb.Heartbeat.from_env() is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv(hb.HEARTBEAT_ENV, str(tmp_path / "missing"))
    assert hb.Heartbeat.from_env() is None


def _record(rank: int, step: int, phase: str, failure: dict[str, object] | None = None,
            line: str = "", stack: list[str] | None = None) -> dict[str, object]:
    return {"rank": rank, "world_size": 3, "pid": 1, "step": step, "epoch": 0,
            "phase": phase, "progress_at": 100.0, "time": 105.0, "line": line,
            "failure": failure, "stack": stack or []}


def test_the_paragraph_names_who_waited_where_and_who_did_not_arrive() -> None:
    waited = {"kind": "timeout", "phase": "agreement", "step": 40, "at": 104.0,
              "error": "Timed out waiting 5000ms", "timeout_s": 5.0}
    beats = {0: _record(0, 40, "agreement", waited, "epoch 3 loss 0.1"),
             1: _record(1, 40, "checkpoint", None, "", ["io.py:3 in write"]),
             2: _record(2, 40, "agreement", {**waited, "at": 104.2})}
    text = hw.diagnose(beats, now=105.5)
    assert text is not None
    assert ("rank(s) 0, 2 waited for 5 s in the stop/loss agreement (an all-reduce) after "
            "step 40, which rank(s) 1 did not reach") in text
    assert "rank 1: in a checkpoint's barrier (gather, then rank 0's write) after step 40, " \
           "no step for 5.5 s, at io.py:3 in write; printed nothing" in text
    assert "rank 0: waiting in" in text and "last line: 'epoch 3 loss 0.1'" in text
    assert hw.diagnose({0: _record(0, 1, "training")}) is None  # no timeout: no hang


def test_a_start_up_timeout_and_a_rank_loading_data_are_named_as_such() -> None:
    joined = {"kind": "timeout", "phase": "joining", "step": 0, "at": 104.0,
              "error": "wait timeout after 4000ms", "timeout_s": 4.0}
    beats = {0: _record(0, 0, "startup", None, "", ["net.py:9 in build"]),
             1: _record(1, 0, "joining", joined), 2: _record(2, 0, "joining", joined)}
    text = hw.diagnose(beats, now=105.0)
    assert text is not None and "the run hung" not in text
    assert ("the start-up timed out: rank(s) 1, 2 waited for 4 s in forming the process "
            "group (start-up), which rank(s) 0 did not join") in text
    assert "rank 0: in its start-up (building the model, loading the data)" in text
    assert "at net.py:9 in build" in text and "raise --startup-timeout" in text
    waited = {"kind": "timeout", "phase": "training", "step": 6, "at": 104.0,
              "error": "Timed out waiting 3000ms", "timeout_s": 3.0}
    beats = {0: _record(0, 6, "training", waited), 1: _record(1, 6, "data"),
             2: _record(2, 6, "training", waited)}
    text = hw.diagnose(beats, now=105.0)
    assert text is not None
    assert ("which rank(s) 1 did not reach: rank(s) 1 hung in data loading (a slow or stuck "
            "data loader)") in text
    assert "rank 1: loading the data of step 7 (waiting for its next batch)" in text


def test_loading_marks_the_wait_for_each_batch(tmp_path: Path) -> None:
    beat = _beat(tmp_path)
    beat.phase = "training"
    seen: list[str] = []

    def batches() -> object:
        for i in range(2):
            seen.append(beat.phase)  # while the loader works on batch i
            yield i

    assert [(i, beat.phase) for i in beat.loading(batches())] == [(0, "training"),
                                                                   (1, "training")]
    assert seen == ["data", "data"] and beat.phase == "training"


def test_a_rank_nccl_aborted_counts_as_waiting_and_dumps_are_named(tmp_path: Path) -> None:
    beats = {0: _record(0, 9, "training"), 1: _record(1, 8, "training"),
             2: _record(2, 9, "training")}
    dump = tmp_path / f"{hb.FLIGHT_RECORDER_PREFIX}0"
    text = hw.diagnose(beats, dumps=[dump], aborted=frozenset({0, 2}), now=110.0)
    assert text is not None
    assert "rank(s) 0, 2 waited in the gradient all-reduce of step 10, which rank(s) 1" in text
    assert "NCCL's watchdog" in text and str(dump) in text
    assert "torch.distributed.flight_recorder.fr_trace" in text


def test_the_watch_stops_the_workers_reports_and_cleans_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    monkeypatch.delenv("TORCH_NCCL_TRACE_BUFFER_SIZE", raising=False)
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", "/users/own/prefix_")  # the user's: kept
    stopped = threading.Event()
    out = tmp_path / "out"
    watch = hw.HangWatch(stopped.set, out / "flight_recorder", flight_recorder=True,
                         settle_s=0.2, poll_s=0.02)
    with watch.installed():
        directory = Path(os.environ[hb.HEARTBEAT_ENV])
        assert os.environ["TORCH_FR_BUFFER_SIZE"] == "2000"
        assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == "/users/own/prefix_"
        (directory / f"{hb.FLIGHT_RECORDER_PREFIX}1").write_text("dump")
        late = hb.Heartbeat(directory, 1, 2)
        late.write()
        waiting = hb.Heartbeat(directory, 0, 2)
        waiting.failed("timeout", RuntimeError("Timed out waiting 3000ms for recv"))
        assert stopped.wait(5)
    assert watch.report is not None and "rank(s) 1 did not reach" in watch.report
    assert (out / "flight_recorder" / f"{hb.FLIGHT_RECORDER_PREFIX}1").read_text() == "dump"
    assert str(out / "flight_recorder") in watch.report
    assert not directory.exists()
    assert hb.HEARTBEAT_ENV not in os.environ and "TORCH_FR_BUFFER_SIZE" not in os.environ
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == "/users/own/prefix_"


def test_a_frozen_rank_is_described_from_the_freshest_evidence() -> None:
    """SIGSTOP freezes a rank's heartbeat thread with it: its file is seconds old and shows
    a step the others have since passed with it. The paragraph says the file stopped, and
    where the waiting ranks prove the rank got to."""
    waited = {"kind": "timeout", "phase": "training", "step": 835, "at": 104.0,
              "error": "Timed out waiting 5000ms", "timeout_s": 5.0}
    beats = {0: {**_record(0, 835, "training", waited), "world_size": 2, "time": 109.9},
             1: {**_record(1, 832, "evaluation"), "world_size": 2, "time": 103.3}}
    text = hw.diagnose(beats, now=110.0)
    assert text is not None
    assert "waited for 5 s in the gradient all-reduce of step 836, which rank(s) 1" in text
    assert ("rank 1: stopped after step 835 (rank(s) 0 finished it, which needs every rank) "
            "and before the collective they waited in; its heartbeat stopped 6.7 s before "
            "this report") in text
    assert "its last heartbeat, from before step 835, said: in the evaluation after step " \
           "832" in text
    assert "rank 1: in the evaluation" not in text  # not presented as where it is
    # a stale file that is not behind the others: its place is the last known one
    beats[1] = {**beats[1], "step": 835, "phase": "training"}
    text = hw.diagnose(beats, now=110.0)
    assert text is not None
    assert ("its heartbeat stopped 6.7 s before this report: the whole process stopped "
            "running") in text
    assert "last known: in step 836 (forward/backward" in text
    # a fresh file before any step says so, instead of counting from the start
    beats[1] = {**_record(1, 0, "training"), "world_size": 2, "time": 109.9}
    text = hw.diagnose(beats, now=110.0)
    assert text is not None and "no step done yet (10.0 s since it started)" in text


def _write_beat(directory: Path, rank: int, pid: int, step: int,
                failure: dict[str, object] | None = None) -> None:
    record = {**_record(rank, step, "training", failure), "world_size": 2, "pid": pid,
              "time": time.time(), "progress_at": time.time()}
    (directory / f"rank{rank}.json").write_text(json.dumps(record))


def test_every_round_torchrun_restarts_is_watched_and_the_last_word_is_its_own(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--max-restarts: the watch ends the hung round, then watches the next one; the first
    round's paragraph is printed when the next round starts, and the run ends with the
    paragraph of the round that ended it."""
    stops: list[float] = []
    timeout = {"kind": "timeout", "phase": "training", "at": time.time(),
               "error": "Timed out waiting 3000ms", "timeout_s": 3.0}
    watch = hw.HangWatch(lambda: stops.append(time.monotonic()), settle_s=0.1, poll_s=0.02)
    with watch.installed():
        assert watch.directory is not None
        # round 1 (pids 10**7 + ...: no such processes, so none is waited for)
        _write_beat(watch.directory, 1, 10**7 + 2, 4)
        _write_beat(watch.directory, 0, 10**7 + 1, 4, {**timeout, "step": 4})
        deadline = time.monotonic() + 5
        while not stops:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert watch.report is not None and "step 5" in watch.report
        assert watch.last_word({10**7 + 1}) == watch.report
        # round 2: new workers; round 1's files are left by its killed workers
        _write_beat(watch.directory, 1, 10**7 + 12, 0)
        deadline = time.monotonic() + 5
        while watch.report is not None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        first = capsys.readouterr().err
        assert "gradient all-reduce of step 5" in first and "torchrun restarted the workers" \
            in first
        _write_beat(watch.directory, 0, 10**7 + 11, 7, {**timeout, "step": 7})
        while len(stops) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert watch.report is not None and "step 8" in watch.report and "step 5" not in \
        watch.report
    assert watch.last_word({10**7 + 11, 10**7 + 12}) == watch.report
    # a run that then ended some other way: the paragraph is history, not its reason
    assert watch.last_word({10**7 + 99}) is None
    assert "gradient all-reduce of step 8" in capsys.readouterr().err


def test_dumps_without_an_output_directory_are_kept_under_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`torchgpu launch` has no --out: the dumps named in the paragraph must outlive the
    heartbeat directory, in ./torchgpu-flight-recorder-<time>."""
    monkeypatch.chdir(tmp_path)
    stopped = threading.Event()
    watch = hw.HangWatch(stopped.set, flight_recorder=True, settle_s=0.1, poll_s=0.02)
    with watch.installed():
        assert watch.directory is not None
        for rank in (0, 1):
            (watch.directory / f"{hb.FLIGHT_RECORDER_PREFIX}{rank}").write_text(f"dump {rank}")
        _write_beat(watch.directory, 1, 10**7 + 2, 2)
        _write_beat(watch.directory, 0, 10**7 + 1, 2, {
            "kind": "timeout", "phase": "training", "step": 2, "at": time.time(),
            "error": "Timed out", "timeout_s": 3.0})
        assert stopped.wait(5)
    assert watch.report is not None
    [kept] = tmp_path.glob(f"{hw.DUMP_DIR_NAME}-*")
    assert sorted(p.read_text() for p in kept.iterdir()) == ["dump 0", "dump 1"]
    assert f"{kept / hb.FLIGHT_RECORDER_PREFIX}0" in watch.report
    assert f"fr_trace {kept} --prefix" in watch.report


def test_a_timed_out_rank_waits_for_the_launcher_before_failing(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """Under the launcher a timed-out rank gives the watch time to end every worker (so
    its own error and torchrun's teardown do not come before the paragraph); a lost peer
    and a rank outside the launcher do not wait."""
    monkeypatch.setenv(hb.HEARTBEAT_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    beat = hb.Heartbeat.from_env()
    assert beat is not None and beat.await_kill_s == hb.AWAIT_KILL_S > 2
    beat.await_kill_s = 0.3
    started = time.monotonic()
    beat.failed("timeout", RuntimeError("Timed out waiting 3000ms"))
    assert time.monotonic() - started >= 0.3
    # The waits not taken are long ones, so that a slow (loaded) machine cannot pass for
    # a wait: a few file writes take milliseconds.
    beat.await_kill_s = 60.0
    started = time.monotonic()
    beat.failed("peer", RuntimeError("Connection closed by peer"))
    assert time.monotonic() - started < 30
    outside = hb.Heartbeat(tmp_path, 1, 2)  # not from the launcher's environment
    assert outside.await_kill_s == 0.0
    started = time.monotonic()
    outside.failed("timeout", RuntimeError("Timed out waiting 3000ms"))
    assert time.monotonic() - started < hb.AWAIT_KILL_S / 2


def test_a_peer_that_went_away_does_not_trigger_the_watch(tmp_path: Path) -> None:
    stopped = threading.Event()
    watch = hw.HangWatch(stopped.set, poll_s=0.02)
    with watch.installed():
        directory = Path(os.environ[hb.HEARTBEAT_ENV])
        hb.Heartbeat(directory, 0, 2).failed("peer", RuntimeError("Connection closed by peer"))
        assert not stopped.wait(0.3)
    assert watch.report is None
    assert hb.HEARTBEAT_ENV not in os.environ


@pytest.mark.parametrize(("error", "kind"), [
    (RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for "
                  "recv operation to complete"), "timeout"),
    (dist.DistBackendError("Watchdog caught collective operation timeout: WorkNCCL(...)"),
     "timeout"),
    (RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                  "[127.0.0.1]:4242"), "peer"),
    (RuntimeError("DataLoader timed out after 5 seconds"), None),  # not a collective
    (RuntimeError("CUDA out of memory"), None),
    (ValueError("shapes do not match"), None),
])
def test_collective_errors_are_told_apart(error: BaseException, kind: str | None) -> None:
    assert hb.collective_failure(error) == kind


def test_the_hang_fault_blocks_only_its_step_and_rank() -> None:
    assert hang_plan_from_env(1, {}) is None
    assert hang_plan_from_env(0, {"TORCHGPU_FAULT_HANG_AT_STEP": "3",
                                  "TORCHGPU_FAULT_RANK": "1"}) is None
    plan = hang_plan_from_env(1, {"TORCHGPU_FAULT_HANG_AT_STEP": "3",
                                  "TORCHGPU_FAULT_RANK": "1"})
    assert plan == HangPlan(3)
    for bad in ("0", "x", "-2"):
        with pytest.raises(ConfigError, match="TORCHGPU_FAULT_HANG_AT_STEP"):
            hang_plan_from_env(0, {"TORCHGPU_FAULT_HANG_AT_STEP": bad})
    steps = [0]
    loss = plan.wrap(lambda out, target: out + target, lambda: steps[0])
    assert loss(1, 2) == 3  # step 1: runs
    steps[0] = 2  # step 3 is next: blocks for good (checked from a thread)
    blocked = threading.Thread(target=loss, args=(1, 2), daemon=True)
    out = io.StringIO()
    sys_stdout = sys.stdout
    try:
        sys.stdout = out
        blocked.start()
        blocked.join(0.3)
    finally:
        sys.stdout = sys_stdout
    assert blocked.is_alive()
    assert "hanging before step 3's gradient all-reduce" in out.getvalue()


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "2147484", "1e10", "1e15"])
def test_collective_timeout_must_be_positive_seconds_within_torchs_range(value: str) -> None:
    """Up to 2**31 - 1 ms: torch's store polls its sockets with an int of milliseconds
    (3e6 s wrapped to a negative wait, 1e10 s failed the rendezvous, 1e15 s overflowed
    Python's timedelta in every worker)."""
    from torchgpu.cli.train_flags import config_from_argv
    from torchgpu.train.config import MAX_COLLECTIVE_TIMEOUT_S
    from torchgpu.train.config_checks import validate

    assert MAX_COLLECTIVE_TIMEOUT_S == 2147483
    config = config_from_argv(["--collective-timeout", value])
    with pytest.raises(ConfigError, match=r"--collective-timeout .* at most 2147483 \(about "
                                          r"24\.9 days"):
        validate(config)
    validate(config_from_argv(["--collective-timeout", "2147483"]))


def test_collective_timeout_reaches_the_workers_and_fit() -> None:
    from torchgpu.cli.train import worker_argv
    from torchgpu.cli.train_flags import config_from_argv
    from torchgpu.train.fit import SETTINGS

    config = config_from_argv(["--collective-timeout", "12.5"])
    assert math.isclose(config.collective_timeout, 12.5)
    argv = worker_argv(config)
    assert argv[argv.index("--collective-timeout") + 1] == "12.5"
    assert "collective_timeout" in SETTINGS
