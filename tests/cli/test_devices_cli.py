"""`torchgpu devices` and `torchgpu select`: golden output over a fake three-GPU NVML,
exit codes, --watch bounded, and two real subprocess runs on this machine."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from tests.nvml_fake import fake_backend
from tests.procs import run_cli
from torchgpu.cli import devices as devices_cli
from torchgpu.cli.main import main
from torchgpu.devices import DeviceInfo, listing, nvml

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("TORCHGPU_UPDATE_GOLDEN") == "1"
FAKE_CPU = DeviceInfo(
    kind="cpu",
    index=None,
    name="Fake CPU",
    total_bytes=64 << 30,
    free_bytes=48 << 30,
    used_bytes=16 << 30,
    cores=16,
)


@pytest.fixture
def fake_machine(monkeypatch):
    """Three NVML GPUs (one NotSupported-heavy, one lost), a fixed CPU and torch version."""
    for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COLUMNS", "180")
    monkeypatch.setattr(listing, "cpu_device_info", lambda: FAKE_CPU)
    monkeypatch.setattr(torch, "__version__", "2.99.0+cpu")
    monkeypatch.setattr(torch.version, "cuda", None)
    with nvml.use_backend(fake_backend()):
        yield


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.write_text(text)
    assert text == path.read_text()


def test_devices_json_golden(fake_machine, capsys):
    assert main(["devices", "--json"]) == 0
    text = capsys.readouterr().out
    data = json.loads(text)
    assert data["schema"] == 1
    assert [d["spec"] for d in data["devices"]] == ["cuda:0", "cuda:1", "cuda:2", "cpu"]
    assert data["devices"][2]["error"] == "GPU is lost"
    assert data["devices"][1]["utilization_pct"] is None
    assert data["torch"]["cuda_usable"] is False
    check_golden("devices_fake.json", text)


def test_devices_table_golden(fake_machine, capsys):
    assert main(["devices"]) == 0
    text = capsys.readouterr().out
    assert "NVIDIA GeForce GTX 1080" in text and "[ERROR: GPU is" in text
    assert "torch cannot use these GPUs: this torch (2.99.0+cpu) is a CPU-only build" in text
    assert "Fake CPU (16 cores)" in text
    check_golden("devices_fake.txt", text)


def test_devices_under_visible_devices(fake_machine, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-2222")
    assert main(["devices", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    gpus = [d for d in data["devices"] if d["kind"] == "cuda"]
    assert [(d["index"], d["nvml_index"], d["name"]) for d in gpus] == [
        (0, 1, "NVIDIA GeForce GTX 1080")
    ]
    assert data["cuda_visible_devices"] == "GPU-2222"


def test_devices_without_gpu_says_why(monkeypatch, capsys):
    monkeypatch.setattr(torch.version, "cuda", None)
    with nvml.use_backend(nvml.StaticBackend(nvml.NvmlInventory(error="no NVML"))):
        assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("No CUDA GPU: ")]
    assert "CPU-only build" in out


def test_watch_is_bounded_and_json_lines(fake_machine, capsys):
    sleeps = []
    code = devices_cli.run(True, 0.5, iterations=3, sleep=sleeps.append)
    assert code == 0 and sleeps == [0.5, 0.5]
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(json.loads(line)["schema"] == 1 for line in lines)


def test_watch_stops_on_ctrl_c(fake_machine, capsys):
    def interrupt(_seconds):
        raise KeyboardInterrupt

    assert devices_cli.run(False, 1.0, sleep=interrupt) == 0
    out = capsys.readouterr().out
    assert out.count("devices (torch numbering") == 1 and "Ctrl-C" in out


@pytest.mark.parametrize("argv", [["--watch", "x"], ["--bad"]])
def test_devices_bad_flags_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(["devices", *argv])
    assert info.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("0", "0"),
        ("-1", "-1"),
        ("nan", "nan"),
        ("inf", "inf"),
        ("1e400", "inf"),
        ("86401", "86401"),
    ],
)
def test_devices_watch_out_of_range_exit_2(value, shown, capsys):
    assert main(["devices", "--watch", value]) == 2
    err = capsys.readouterr().err
    assert f"--watch {shown} must be a positive number of seconds up to 86400" in err
    assert "Traceback" not in err


def test_devices_help_shows_the_json_schema(capsys):
    with pytest.raises(SystemExit) as info:
        main(["devices", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "stable schema" in out
    assert devices_cli.JSON_SCHEMA.strip() in out  # verbatim, line breaks kept


def test_json_schema_names_exactly_the_keys_printed(fake_machine, capsys):
    assert main(["devices", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    printed = set(data) | set(data["torch"]) | set(data["nvml"])
    for device in data["devices"]:
        printed |= set(device)
        for process in device["processes"] or []:
            printed |= set(process)
    documented = re.sub(r"#.*", "", devices_cli.JSON_SCHEMA)  # comments quote values
    assert set(re.findall(r'"(\w+)":', documented)) == printed


@pytest.mark.parametrize(
    ("argv", "code", "stdout", "stderr"),
    [
        (["-n", "1"], 0, "0\n", ""),
        (["-n", "2"], 0, "0,1\n", ""),
        (["-n", "1", "--min-free", "61GiB"], 3, "", "only 0 of 3 qualify"),
        (["-n", "2", "--max-util", "50"], 3, "", "unknown utilisation"),
        (["-n", "4"], 3, "", "only 2 of 3 qualify"),
        (["-n", "0"], 2, "", "-n 0 must be at least 1"),
        (["--min-free", "lots"], 2, "", "size 'lots' is not understood"),
        (["--max-util", "120"], 2, "", "not a percentage"),
    ],
)
def test_select(fake_machine, capsys, argv, code, stdout, stderr):
    assert main(["select", *argv]) == code
    captured = capsys.readouterr()
    assert captured.out == stdout
    assert stderr in captured.err


def test_select_flag_typo_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["select", "-n", "two"])
    assert info.value.code == 2


@pytest.mark.slow
def test_subprocess_devices_and_select_on_this_machine():
    result = run_cli(["devices"], timeout=60, COLUMNS="150")
    assert result.returncode == 0, result.stderr
    assert "cpu" in result.stdout
    if not torch.cuda.is_available():
        assert "No CUDA GPU: " in result.stdout
        selected = run_cli(["select", "-n", "1"], timeout=60)
        assert selected.returncode == 3
        assert selected.stdout == ""
        assert "none is visible" in selected.stderr and "Traceback" not in selected.stderr
