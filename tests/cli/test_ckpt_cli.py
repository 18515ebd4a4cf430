"""``torchgpu ckpt inspect|convert|verify``: in-process through the real dispatcher
(``torchgpu.cli.main.main``) for speed, and in child processes where the exit code,
stderr and environment variables of a real run are the point."""

from __future__ import annotations

import fractions
import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.procs import run_cli
from torchgpu.checkpoint import save_checkpoint
from torchgpu.cli.main import main


def cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run ``torchgpu ARGS`` in-process; returns (exit code, stdout, stderr)."""
    try:
        code = main(args)
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))


def test_inspect_our_checkpoint_json_and_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save_checkpoint(tmp_path / "ck" / "step-4", model=_net(), step=4, epoch=1,
                    meta={"config": {"lr": 0.5}})
    code, out, err = cli(["ckpt", "inspect", str(tmp_path / "ck"), "--json"], capsys)
    assert code == 0, err
    info = json.loads(out)
    assert info["format"] == "torchgpu-dir" and info["step"] == 4 and info["epoch"] == 1
    assert info["meta"]["config"] == {"lr": 0.5} and info["complete"] is True
    assert info["num_tensors"] == 4 and info["total_bytes"] == (15 + 5 + 10 + 2) * 4
    assert set(info["groups"]) == {"0", "2"}
    code, out, err = cli(["ckpt", "inspect", str(tmp_path / "ck" / "step-4")], capsys)
    assert code == 0, err
    assert "step:    4" in out and "0.weight" in out and "config:  {\"lr\": 0.5}" in out
    assert "wrapper prefixes: none" in out


@pytest.mark.slow
def test_inspect_pickle_lists_unsafe_globals_without_running_them(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    torch.save({"w": torch.ones(1), "x": Payload(marker)}, tmp_path / "evil.pt")
    done = run_cli(["ckpt", "inspect", str(tmp_path / "evil.pt"), "--json"], timeout=120,
                   TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")
    assert done.returncode == 0, done.stderr
    assert any(g.endswith(".system") for g in json.loads(done.stdout)["unsafe_globals"])
    refused = run_cli(["ckpt", "convert", str(tmp_path / "evil.pt"), str(tmp_path / "o.pt")],
                      timeout=120, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")
    assert refused.returncode == 2
    assert "refused" in refused.stderr and "--trust-checkpoint" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert not marker.exists() and not (tmp_path / "o.pt").exists()


def test_convert_dp_layout_and_back(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _net()
    save_checkpoint(tmp_path / "ck", model=model)
    code, out, err = cli(["ckpt", "convert", str(tmp_path / "ck"), str(tmp_path / "dp.pt"),
                          "--to", "dp"], capsys)
    assert code == 0, err
    assert "added prefix 'module.'" in out
    state = torch.load(tmp_path / "dp.pt", weights_only=True)
    dp = nn.DataParallel(nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2)))
    dp.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(dp.module.state_dict().values(),
                                                  model.state_dict().values(), strict=True))
    code, out, err = cli(["ckpt", "convert", str(tmp_path / "dp.pt"), str(tmp_path / "p.bin"),
                          "--format", "safetensors"], capsys)
    assert code == 0 and "removed prefix 'module.'" in out, err
    assert (tmp_path / "p.bin").read_bytes()[8:9] == b"{"  # safetensors despite the suffix
    code, out, err = cli(["ckpt", "convert", str(tmp_path / "dp.pt"), str(tmp_path / "p.bin")],
                         capsys)
    assert code == 2 and "already exists" in err and "Traceback" not in err


def test_inspect_missing_or_malformed_file_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint at all")
    for path in (tmp_path / "junk.pt", tmp_path / "absent.pt"):
        code, out, err = cli(["ckpt", "inspect", str(path)], capsys)
        assert code == 2 and path.name in err and out == ""
        assert err.count("\n") == 1


def test_verify_good_corrupt_and_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = save_checkpoint(tmp_path / "ck" / "step-1", model=_net(), step=1)
    code, out, err = cli(["ckpt", "verify", str(tmp_path / "ck")], capsys)
    assert code == 0 and out.startswith("ok:") and "step-1" in out, err
    code, out, err = cli(["ckpt", "verify", str(tmp_path / "nope")], capsys)
    assert code == 2 and "no such file" in err
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    bad = run_cli(["ckpt", "verify", str(ckpt)], timeout=120)  # the real exit status
    assert bad.returncode == 1
    assert "model.safetensors" in bad.stderr and "sha256" in bad.stderr
    assert "Traceback" not in bad.stderr and bad.stdout == ""


@pytest.mark.parametrize("args", [["inspect"], ["frobnicate", "x"], ["convert", "a"]])
def test_bad_usage_exits_2_with_one_paragraph(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = cli(["ckpt", *args], capsys)
    assert code == 2 and "Traceback" not in err
    assert err.strip().count("\n") <= 2


def _run_with_truncated_latest(root: Path, *, with_good_earlier: bool) -> Path:
    """A run directory whose `latest` (step-2) has a truncated model.safetensors."""
    checkpoints = root / "checkpoints"
    if with_good_earlier:
        save_checkpoint(checkpoints / "step-1", model=_net(), step=1)
    bad = save_checkpoint(checkpoints / "step-2", model=_net(), step=2)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    return bad


def test_verify_run_dir_checks_the_checkpoint_latest_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not a fallback: `ckpt verify RUN` fails (exit 1) when `latest` is damaged, naming
    the bad file, even when an older checkpoint is fine (and names that one as a hint)."""
    bad = _run_with_truncated_latest(tmp_path / "r2", with_good_earlier=True)
    for path in (tmp_path / "r2", tmp_path / "r2" / "checkpoints"):
        code, out, err = cli(["ckpt", "verify", str(path)], capsys)
        assert code == 1 and out == "", out
        assert str(bad / "model.safetensors") in err and "truncated" in err
        assert str(tmp_path / "r2" / "checkpoints" / "step-1") in err
        assert "Warning" not in err
    only = _run_with_truncated_latest(tmp_path / "r3", with_good_earlier=False)
    code, out, err = cli(["ckpt", "verify", str(tmp_path / "r3")], capsys)
    assert code == 1 and str(only / "model.safetensors") in err, err
    (tmp_path / "r3" / "checkpoints" / "latest").write_text("step-9\n")
    code, out, err = cli(["ckpt", "verify", str(tmp_path / "r3")], capsys)
    assert code == 1 and "'step-9'" in err and "latest" in err, err


def test_verify_without_latest_checks_every_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for step in (1, 2):
        save_checkpoint(tmp_path / "ck" / f"step-{step}", model=_net(), step=step)
    (tmp_path / "ck" / "latest").unlink()
    code, out, err = cli(["ckpt", "verify", str(tmp_path / "ck")], capsys)
    assert code == 0, err
    assert [line.split()[1] for line in out.splitlines()] == [
        str(tmp_path / "ck" / "step-1"), str(tmp_path / "ck" / "step-2")]
    state = tmp_path / "ck" / "step-1" / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    code, out, err = cli(["ckpt", "verify", str(tmp_path / "ck")], capsys)
    assert code == 1 and str(state) in err and "sha256" in err
    assert out.startswith(f"ok: {tmp_path / 'ck' / 'step-2'}")


def test_inspect_run_dir_reports_an_incomplete_latest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ckpt inspect RUN` looks at what `latest` names, complete or not."""
    for name, earlier in (("r3", False), ("r2", True)):
        bad = _run_with_truncated_latest(tmp_path / name, with_good_earlier=earlier)
        code, out, err = cli(["ckpt", "inspect", str(tmp_path / name)], capsys)
        assert code == 0, err
        assert f"path:    {bad}" in out and "complete: NO" in out and "step:    2" in out
        assert "truncated" in out  # why its tensors cannot be listed
        code, out, err = cli(["ckpt", "inspect", str(tmp_path / name), "--json"], capsys)
        info = json.loads(out)
        assert info["complete"] is False and info["path"] == str(bad) and info["step"] == 2


def test_a_fallback_is_a_note_not_a_python_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`latest` names a missing directory: inspect uses the newest complete one and says
    so in one `note:` line, in-process and in a real process (no file:line warning)."""
    save_checkpoint(tmp_path / "ck" / "step-1", model=_net(), step=1)
    (tmp_path / "ck" / "latest").write_text("step-7\n")
    code, out, err = cli(["ckpt", "inspect", str(tmp_path / "ck")], capsys)
    assert code == 0 and f"path:    {tmp_path / 'ck' / 'step-1'}" in out
    assert err.startswith("note:") and "'step-7'" in err
    done = run_cli(["ckpt", "inspect", str(tmp_path / "ck")], timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith("note:") and done.stderr.count("\n") == 1
    assert "Warning" not in done.stderr and ".py:" not in done.stderr


def test_small_input_checks_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_checkpoint(tmp_path / "ck", model=_net())
    code, out, err = cli(["ckpt", "inspect", str(tmp_path / "ck"), "--keys", "-1"], capsys)
    assert code == 2 and "--keys" in err and "-1" in err and out == ""
    missing = tmp_path / "nonexist" / "dir"
    code, out, err = cli(["ckpt", "convert", str(tmp_path / "ck"), str(missing / "y.pt")],
                         capsys)
    assert code == 2 and str(missing) in err and "Traceback" not in err
    assert not (tmp_path / "nonexist").exists()


def test_convert_with_trust_says_so_in_a_note(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.save({"w": torch.ones(2), "n": fractions.Fraction(1, 3)}, tmp_path / "odd.pt")
    code, out, err = cli(["ckpt", "convert", str(tmp_path / "odd.pt"), str(tmp_path / "o.pt"),
                          "--trust-checkpoint"], capsys)
    assert code == 0 and out.startswith("wrote"), err
    assert err.startswith("note:") and "full unpickler" in err and "Warning" not in err
