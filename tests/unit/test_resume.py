"""Exact resume of `torchgpu train`: a run stopped at any step and resumed ends with
bitwise identical weights and loss history; negative controls prove the test can fail;
--resume errors, `latest` fallback, orphan temporaries, signals and a second SIGINT."""

from __future__ import annotations

import fractions
import json
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tests.procs import START_S, run_cli, test_env
from tests.step_limit import train_until
from torchgpu.checkpoint import atomic, verify_checkpoint
from torchgpu.cli.main import main
from torchgpu.errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    ConfigError,
    ResumeError,
)
from torchgpu.examples import housing
from torchgpu.launch.stop_record import StopFlag
from torchgpu.train.config import TrainConfig
from torchgpu.train.hooks.faults import crash_plan_from_env
from torchgpu.train.outputs.report import TrainResult
from torchgpu.train.runner import train
from torchgpu.train.state import TrainState

BUILTIN_MODEL = housing.build_model
# 100 samples -> 80 train rows, batch 16 -> 5 micro-batches per epoch.
BASE = {"example": "housing", "data_size": 100, "epochs": 3, "batch_size": 16,
        "progress": "off", "device": "cpu"}
TIMING = ("seconds", "samples_per_s")


def _dropout_model(data: Any) -> nn.Module:
    """A model whose forward pass consumes the global RNG (dropout); built, as the housing
    plug-in's net is, under torch.manual_seed(seed)."""
    return nn.Sequential(nn.Linear(data.input_shape[0], 32), nn.ReLU(), nn.Dropout(0.3),
                         nn.Linear(32, data.num_outputs))


@pytest.fixture(autouse=True)
def dropout_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(housing, "build_model", _dropout_model)


def _config(out: Path, **kw: Any) -> TrainConfig:
    return TrainConfig(out=str(out), **{**BASE, **kw})


def _weights(result: TrainResult) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in result.model.state_dict().items()}


def _metrics(out: Path) -> list[dict[str, Any]]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in x.items() if k not in TIMING} for x in lines]


def _identical(a: TrainResult, b: TrainResult) -> bool:
    wa, wb = _weights(a), _weights(b)
    return (wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
            and a.state.step_losses == b.state.step_losses
            and a.state.epoch_losses == b.state.epoch_losses)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, TrainResult]]:
    """Uninterrupted runs (dropout model), by --accumulate."""
    patch = pytest.MonkeyPatch()
    patch.setattr(housing, "build_model", _dropout_model)
    root = tmp_path_factory.mktemp("reference")
    try:
        yield {k: train(_config(root / f"acc{k}", accumulate=k)) for k in (1, 2)}
    finally:
        patch.undo()


@pytest.mark.parametrize(("accumulate", "stop_at"), [
    (1, 1),  # after the first step
    (1, 7),  # mid-epoch (epoch 2, batch 2 of 5)
    (1, 10),  # the last step of an epoch, before its evaluation
    (2, 4),  # mid-epoch with accumulation (windows 2, 2, 1 per epoch)
])
def test_stop_and_resume_is_bitwise_identical(
    tmp_path: Path, reference: dict[int, TrainResult], accumulate: int, stop_at: int,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "run"
    first = train_until(stop_at, _config(out, accumulate=accumulate, save_every=3))
    assert first.state.step == stop_at and first.summary["stopped_early"]
    assert first.summary["checkpoints"]["last"].endswith(f"step-{stop_at:08d}")
    err = capsys.readouterr().err
    assert f"after step {stop_at}" in err and "--resume" in err
    # A fresh call with --resume (default: this --out's latest) continues into the same --out.
    resumed = train(_config(out, accumulate=accumulate, resume=""))
    assert resumed.summary["checkpoints"]["resumed_from"].endswith(f"step-{stop_at:08d}")
    ref = reference[accumulate]
    assert _identical(resumed, ref)
    assert _metrics(out) == _metrics(ref.out_dir or Path())  # rewritten, then continued
    assert resumed.summary["epochs"] == ref.summary["epochs"] == BASE["epochs"]


def test_resume_twice_then_to_the_end(tmp_path: Path, reference: dict[int, TrainResult]) -> None:
    out = tmp_path / "run"
    train_until(3, _config(out))
    second = train_until(8, _config(out, resume=""))
    assert second.state.step == 8
    assert _identical(train(_config(out, resume=str(out / "checkpoints"))), reference[1])


def test_resume_dir_into_a_new_out_rebuilds_the_history(
    tmp_path: Path, reference: dict[int, TrainResult]
) -> None:
    first = tmp_path / "first"
    train_until(7, _config(first))
    step_dir = first / "checkpoints" / "step-00000007"
    resumed = train(_config(tmp_path / "second", resume=str(step_dir)))
    assert _identical(resumed, reference[1])
    assert _metrics(tmp_path / "second") == _metrics(reference[1].out_dir or Path())


@pytest.mark.gpu
def test_resume_on_cuda_matches_to_float_tolerance(tmp_path: Path) -> None:
    """On a GPU the CUDA RNG is restored too; kernels may not be bitwise deterministic."""
    full = train(_config(tmp_path / "full", device="cuda"))
    out = tmp_path / "run"
    train_until(7, _config(out, device="cuda"))
    resumed = train(_config(out, device="cuda", resume=""))
    for key, value in _weights(full).items():
        torch.testing.assert_close(_weights(resumed)[key], value, rtol=1e-4, atol=1e-5)
    assert resumed.state.step_losses == pytest.approx(full.state.step_losses, rel=1e-4)


@pytest.mark.parametrize("dropped", ["rng", "position", "sampler"])
def test_negative_controls_make_the_equivalence_fail(
    tmp_path: Path, reference: dict[int, TrainResult], monkeypatch: pytest.MonkeyPatch,
    dropped: str,
) -> None:
    """Without the RNG state, the data position or the sampler's epoch, resuming differs:
    the equivalence test above can fail, so its passing means something."""
    out = tmp_path / "run"
    train_until(7, _config(out))
    from torchgpu.train.checkpoints import run_checkpoints as checkpointing

    if dropped == "rng":
        monkeypatch.setattr(checkpointing, "restore_rng_state", lambda state: None)
    elif dropped == "position":
        original = TrainState.from_dict

        def no_position(data: dict[str, Any]) -> TrainState:
            state = original(data)
            state.batch_in_epoch = 0  # the epoch restarts from its first batch
            return state

        monkeypatch.setattr(TrainState, "from_dict", staticmethod(no_position))
    else:
        from torchgpu.data.shards import ShardBatches  # the training loader's sampler

        monkeypatch.setattr(ShardBatches, "set_epoch", lambda self, epoch: None)
    assert not _identical(train(_config(out, resume="")), reference[1])


def test_resume_without_a_checkpoint_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "new"
    code = main(["train", "--example", "housing", "--data-size", "60", "--epochs", "1",
                 "--out", str(out), "--resume"])
    err = capsys.readouterr().err
    assert code == 2 and "--resume found no complete checkpoint" in err
    assert "Traceback" not in err and not out.exists()
    with pytest.raises(ResumeError, match="nothing to continue from"):
        train(_config(tmp_path / "other", resume=str(tmp_path / "nowhere")))
    assert not (tmp_path / "other").exists()


def test_changed_settings_are_refused(tmp_path: Path) -> None:
    out = tmp_path / "run"
    train_until(2, _config(out))
    with pytest.raises(ResumeError, match=r"batch_size 16 -> 8"):
        train(_config(out, resume="", batch_size=8))


def test_incomplete_latest_falls_back_and_orphans_are_cleaned(
    tmp_path: Path, reference: dict[int, TrainResult], capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    train_until(7, _config(out, save_every=3))
    checkpoints = out / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step-00000007"
    (checkpoints / "step-00000007" / "manifest.json").unlink()  # an interrupted commit
    orphan = checkpoints / f".step-00000009.tmp-{socket.gethostname()}-999999999-0123abcd"
    orphan.mkdir()
    (orphan / "state.pt").write_bytes(b"half written")
    capsys.readouterr()
    resumed = train(_config(out, resume=""))
    err = capsys.readouterr().err
    assert "newest complete checkpoint 'step-00000006'" in err
    assert resumed.summary["checkpoints"]["resumed_from"].endswith("step-00000006")
    assert not orphan.exists()
    assert _identical(resumed, reference[1])


def test_resume_from_an_earlier_checkpoint_sets_the_abandoned_branch_aside(
    tmp_path: Path, reference: dict[int, TrainResult], capsys: pytest.CaptureFixture[str]
) -> None:
    """Resuming from step 6 of a run that went on to step 15: the later checkpoints belong
    to the abandoned branch. They are moved aside (not deleted) with a message before
    training continues, --keep-last prunes only this run's line, and `latest` names the
    newest save of the current run."""
    out = tmp_path / "run"
    train(_config(out, save_every=3))  # saves steps 3, 6, 9, 12, 15
    checkpoints = out / "checkpoints"
    capsys.readouterr()
    branch = train_until(8, _config(out, save_every=3, keep_last=2,
                                    resume=str(checkpoints / "step-00000006")))
    err = capsys.readouterr().err
    aside = out / "checkpoints-abandoned-after-step-00000006"
    assert "step-00000009, step-00000012, step-00000015" in err and str(aside) in err
    assert sorted(p.name for p in aside.iterdir()) == [
        "step-00000009", "step-00000012", "step-00000015"]
    for directory in aside.iterdir():
        verify_checkpoint(directory)  # moved whole, still loadable
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "latest", "step-00000006", "step-00000008"]
    assert (checkpoints / "latest").read_text().strip() == "step-00000008"
    assert branch.summary["checkpoints"]["last"].endswith("step-00000008")
    final = train(_config(out, save_every=3, keep_last=2, resume=""))
    assert final.summary["checkpoints"]["resumed_from"].endswith("step-00000008")
    assert _identical(final, reference[1])
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "latest", "step-00000012", "step-00000015"]


def test_resume_from_a_corrupt_latest_names_or_uses_the_newest_that_verifies(
    tmp_path: Path, reference: dict[int, TrainResult], capsys: pytest.CaptureFixture[str]
) -> None:
    """A bit flip keeps the size, so `latest` looks complete until its sha256 is checked.
    Named explicitly, the error names the newest checkpoint that verifies; reached through
    `latest`, the run falls back to it with a note (as for an incomplete one)."""
    out = tmp_path / "run"
    train_until(7, _config(out, save_every=3))  # saves steps 3, 6, 7
    bad = out / "checkpoints" / "step-00000007"
    data = bytearray((bad / "state.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (bad / "state.pt").write_bytes(bytes(data))
    good = out / "checkpoints" / "step-00000006"
    with pytest.raises(CheckpointCorruptError, match=re.escape(f"--resume {good}")):
        train(_config(out, resume=str(bad)))
    capsys.readouterr()
    resumed = train(_config(out, resume=""))
    err = capsys.readouterr().err
    assert "note:" in err and "state.pt" in err and "step-00000006" in err
    assert resumed.summary["checkpoints"]["resumed_from"] == str(good)
    assert _identical(resumed, reference[1])


def test_trust_checkpoint_flag_reaches_the_loader(
    tmp_path: Path, reference: dict[int, TrainResult]
) -> None:
    """`torchgpu train --trust-checkpoint` is the only way to resume from a state.pt that
    needs globals outside the weights-only allowlist."""
    from torchgpu.checkpoint.layout import MANIFEST_FILE
    from torchgpu.checkpoint.manifest import manifest_bytes
    from torchgpu.cli.train import worker_argv
    from torchgpu.cli.train_flags import config_from_argv

    trusting = config_from_argv(["--resume", "--out", "x", "--trust-checkpoint"])
    assert trusting.trust_checkpoint and "--trust-checkpoint" in worker_argv(trusting)
    assert "--trust-checkpoint" not in worker_argv(config_from_argv(["--out", "x"]))
    out = tmp_path / "run"
    train_until(4, _config(out))
    ckpt = out / "checkpoints" / "step-00000004"
    state = torch.load(ckpt / "state.pt", weights_only=True)
    state["extra"]["note"] = fractions.Fraction(1, 3)  # not weights-only loadable
    torch.save(state, ckpt / "state.pt")
    names = ("model.safetensors", "state.pt", "meta.json")
    (ckpt / MANIFEST_FILE).write_bytes(manifest_bytes({n: (ckpt / n).read_bytes()
                                                       for n in names}))
    with pytest.raises(CheckpointFormatError, match="--trust-checkpoint"):
        train(_config(out, resume=""))
    with pytest.warns(UserWarning, match="full unpickler"):
        resumed = train(_config(out, resume="", trust_checkpoint=True))
    assert _identical(resumed, reference[1])


def test_keep_last_prunes_old_checkpoints(tmp_path: Path) -> None:
    out = tmp_path / "run"
    train(_config(out, epochs=2, save_every=2, keep_last=2))  # saves at steps 2, 4, 6, 8, 10
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["latest", "step-00000008", "step-00000010"]


def test_second_sigint_during_a_save_leaves_the_previous_checkpoint(
    tmp_path: Path, reference: dict[int, TrainResult], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt (the second SIGINT) raised while step 6's files are written."""
    out = tmp_path / "run"
    writes = {"n": 0}
    real_write = atomic._write

    def interrupted(fd: int, data: memoryview) -> int:
        if (out / "checkpoints" / "step-00000003").exists():
            writes["n"] += 1
            if writes["n"] == 2:  # inside the second checkpoint, after its first file
                raise KeyboardInterrupt
        return real_write(fd, data)

    monkeypatch.setattr(atomic, "_write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(_config(out, save_every=3))
    monkeypatch.setattr(atomic, "_write", real_write)
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step-00000003"]
    assert (checkpoints / "latest").read_text().strip() == "step-00000003"
    verify_checkpoint(checkpoints / "step-00000003")
    assert _identical(train(_config(out, resume="")), reference[1])


def test_stop_flag_second_sigint_raises() -> None:
    flag = StopFlag()
    flag._handle(signal.SIGTERM, None)
    assert flag.is_set() and flag.signal_name == "SIGTERM"
    flag._handle(signal.SIGTERM, None)  # a repeated SIGTERM only keeps the flag set
    with pytest.raises(KeyboardInterrupt):
        flag._handle(signal.SIGINT, None)


def test_workers_resume_is_exact_for_the_examples(tmp_path: Path) -> None:
    full = train(_config(tmp_path / "full", epochs=2, num_workers=2))
    out = tmp_path / "run"
    train_until(6, _config(out, epochs=2, num_workers=2))
    resumed = train(_config(out, epochs=2, num_workers=2, resume=""))
    assert _identical(resumed, full)


def test_fault_variables_are_read_once_and_checked(tmp_path: Path) -> None:
    marker = tmp_path / "crashed"
    env = {"TORCHGPU_FAULT_CRASH_AT_STEP": "4", "TORCHGPU_FAULT_MARKER": str(marker)}
    plan = crash_plan_from_env(0, env)
    assert plan is not None and plan.step == 4 and plan.marker == marker
    plan.maybe_crash(3)  # not the step: nothing happens
    assert crash_plan_from_env(1, env) is None  # another rank
    assert crash_plan_from_env(1, {**env, "TORCHGPU_FAULT_RANK": "1"}) is not None
    marker.write_text("done")
    assert crash_plan_from_env(0, env) is None  # already crashed once
    assert crash_plan_from_env(0, {}) is None
    with pytest.raises(ConfigError, match="TORCHGPU_FAULT_MARKER"):
        crash_plan_from_env(0, {"TORCHGPU_FAULT_CRASH_AT_STEP": "4"})
    with pytest.raises(ConfigError, match="'x'"):
        crash_plan_from_env(0, {"TORCHGPU_FAULT_CRASH_AT_STEP": "x"})


# -- real processes -------------------------------------------------------------------

LONG = ["--example", "housing", "--data-size", "100", "--batch-size", "16", "--epochs", "300",
        "--progress", "off", "--device", "cpu"]


@pytest.fixture(scope="module")
def long_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The uninterrupted LONG run (built-in model, as in the subprocesses)."""
    from torchgpu.cli.train_flags import config_from_argv

    out = tmp_path_factory.mktemp("long") / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(housing, "build_model", BUILTIN_MODEL)
        train(config_from_argv([*LONG, "--out", str(out)]))
    return load_file(out / "model.safetensors")


def _start(out: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "torchgpu", "train", *LONG, "--out", str(out), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=test_env())


def _wait_for(path: Path, proc: subprocess.Popen[str], timeout_s: float = START_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{path} never appeared: {proc.communicate()[1][-2000:]}")
        time.sleep(0.01)


def _same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_sigterm_saves_exits_0_and_a_new_process_resumes_identically(
    tmp_path: Path, long_reference: dict[str, torch.Tensor]
) -> None:
    out = tmp_path / "run"
    proc = _start(out, "--save-every", "40")
    _wait_for(out / "checkpoints" / "latest", proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert "stopped by SIGTERM after step" in err and "--resume" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_early"] and summary["stop_reason"] == "SIGTERM"
    stopped_at = summary["steps"]
    assert 40 <= stopped_at < 1500
    last = out / "checkpoints" / f"step-{stopped_at:08d}"
    assert (out / "checkpoints" / "latest").read_text().strip() == last.name
    verify_checkpoint(last)
    done = run_cli(["train", *LONG, "--out", str(out), "--resume"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"resuming from {last}" in done.stderr
    assert _same_weights(load_file(out / "model.safetensors"), long_reference)


@pytest.mark.slow
def test_double_sigint_never_leaves_a_corrupt_checkpoint(tmp_path: Path) -> None:
    """Whenever the second SIGINT lands (training or inside a save), every checkpoint on
    disk verifies and `latest` names one (resuming from such a one is tested above)."""
    out = tmp_path / "run"
    proc = _start(out, "--save-every", "5")
    _wait_for(out / "checkpoints" / "latest", proc)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)  # at once: lands in training or inside a save
    _, err = proc.communicate(timeout=60)
    assert proc.returncode in (0, 130), err[-2000:]
    assert "Traceback" not in err
    checkpoints = out / "checkpoints"
    ours = [p for p in checkpoints.iterdir() if p.name != "latest"]
    assert ours and not [p for p in ours if p.name.startswith(".")]  # no temporaries
    for directory in ours:
        verify_checkpoint(directory)
    assert (checkpoints / (checkpoints / "latest").read_text().strip()).is_dir()


def test_no_cuda_initialised() -> None:
    assert not torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
