"""``torchgpu ckpt inspect|convert|verify`` end to end, in child processes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.procs import run_cli
from torchgpu.checkpoint import save_checkpoint


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))


def test_inspect_our_checkpoint_json_and_text(tmp_path: Path) -> None:
    save_checkpoint(tmp_path / "ck" / "step-4", model=_net(), step=4, epoch=1,
                    meta={"config": {"lr": 0.5}})
    done = run_cli(["ckpt", "inspect", str(tmp_path / "ck"), "--json"], timeout=120)
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["format"] == "torchgpu-dir" and info["step"] == 4 and info["epoch"] == 1
    assert info["meta"]["config"] == {"lr": 0.5} and info["complete"] is True
    assert info["num_tensors"] == 4 and info["total_bytes"] == (15 + 5 + 10 + 2) * 4
    assert set(info["groups"]) == {"0", "2"}
    text = run_cli(["ckpt", "inspect", str(tmp_path / "ck" / "step-4")], timeout=120)
    assert text.returncode == 0, text.stderr
    assert "step:    4" in text.stdout and "0.weight" in text.stdout
    assert "wrapper prefixes: none" in text.stdout


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


def test_convert_dp_layout_and_back(tmp_path: Path) -> None:
    model = _net()
    save_checkpoint(tmp_path / "ck", model=torch.compile(model))
    done = run_cli(["ckpt", "convert", str(tmp_path / "ck"), str(tmp_path / "dp.pt"),
                    "--to", "dp"], timeout=120)
    assert done.returncode == 0, done.stderr
    assert "added prefix 'module.'" in done.stdout
    state = torch.load(tmp_path / "dp.pt", weights_only=True)
    dp = nn.DataParallel(nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2)))
    dp.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(dp.module.state_dict().values(),
                                                  model.state_dict().values(), strict=True))
    back = run_cli(["ckpt", "convert", str(tmp_path / "dp.pt"), str(tmp_path / "p.bin"),
                    "--format", "safetensors"], timeout=120)
    assert back.returncode == 0, back.stderr
    again = run_cli(["ckpt", "convert", str(tmp_path / "dp.pt"), str(tmp_path / "p.bin")],
                    timeout=120)
    assert again.returncode == 2 and "already exists" in again.stderr


def test_verify_good_corrupt_and_missing(tmp_path: Path) -> None:
    ckpt = save_checkpoint(tmp_path / "ck" / "step-1", model=_net(), step=1)
    good = run_cli(["ckpt", "verify", str(tmp_path / "ck")], timeout=120)
    assert good.returncode == 0 and good.stdout.startswith("ok:"), good.stderr
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    bad = run_cli(["ckpt", "verify", str(ckpt)], timeout=120)
    assert bad.returncode == 1
    assert "model.safetensors" in bad.stderr and "sha256" in bad.stderr
    assert "Traceback" not in bad.stderr
    missing = run_cli(["ckpt", "verify", str(tmp_path / "nope")], timeout=120)
    assert missing.returncode == 2 and "no such file" in missing.stderr


@pytest.mark.parametrize("args", [["inspect"], ["frobnicate", "x"], ["convert", "a"]])
def test_bad_usage_exits_2_with_one_paragraph(args: list[str]) -> None:
    done = run_cli(["ckpt", *args], timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().count("\n") <= 2
