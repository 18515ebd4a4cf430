"""`torchgpu devices`, `select` and `env` answer without importing torch where NVML (or a
CPU-only build of torch) is enough; `import torchgpu` and the CLI entry never import it.

Each check runs in a child process whose path starts with a stand-in ``torch`` package:
its ``version.py`` says which build is installed, and its ``__init__`` raises, so any
import of torch fails the command. A fake ``pynvml`` module (tests/nvml_fake.py's three
GPUs, or one whose ``nvmlInit`` fails) stands in for the driver.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import REPO, test_env

# Run a verb like `python -m torchgpu`, then report what was imported.
CHILD = """
import json, sys
from torchgpu.cli.main import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "torch": "torch" in sys.modules}), file=sys.stderr)
sys.exit(code)
"""

WATCH_CHILD = """
import json, sys
from torchgpu.cli import devices
seen = []
def collect():
    seen.append(set(sys.modules))
    return devices.snapshot()
code = devices.run(True, 0.01, iterations=3, sleep=lambda s: None, collect=collect)
print(json.dumps({"code": code, "torch": "torch" in sys.modules,
                  "new": sorted(seen[-1] - seen[1])}), file=sys.stderr)
"""

FAKE_PYNVML = """
from tests.nvml_fake import make_pynvml
globals().update(vars(make_pynvml({init_error})))
"""


def fake_install(root: Path, *, cuda: str | None, nvml: bool) -> Path:
    """A directory to put first on the path: torch that cannot be imported, fake pynvml."""
    torch_dir = root / "torch"
    torch_dir.mkdir(parents=True)
    (torch_dir / "__init__.py").write_text("raise ImportError('torch was imported')\n")
    (torch_dir / "version.py").write_text(
        "from typing import Optional\n\n"
        f"__version__ = '2.99.0{'+cu124' if cuda else '+cpu'}'\n"
        "debug = False\n"
        f"cuda: Optional[str] = {cuda!r}\n"
        "hip: Optional[str] = None\n"
    )
    init_error = "" if nvml else "init_error=9"  # 9: NVML_ERROR_DRIVER_NOT_LOADED
    (root / "pynvml.py").write_text(FAKE_PYNVML.format(init_error=init_error))
    return root


def run(
    root: Path, code: str, *argv: str, **env: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, object]]:
    """Run ``python -c code argv...`` on the fake install; the report is stderr's last line."""
    result = python(root, "-c", code, *argv, **env)
    report = json.loads(result.stderr.strip().splitlines()[-1])
    return result, report


def python(root: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = test_env()
    environ["PYTHONPATH"] = os.pathsep.join([str(root), environ["PYTHONPATH"], str(REPO)])
    for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        environ.pop(name, None)
    environ.update(env)
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=60, env=environ,
        check=False,
    )


@pytest.fixture
def cuda_machine(tmp_path: Path) -> Path:
    """A CUDA build of torch and NVML's three fake GPUs."""
    return fake_install(tmp_path, cuda="12.4", nvml=True)


def test_devices_json_from_nvml_without_torch(cuda_machine: Path) -> None:
    result, report = run(cuda_machine, CHILD, "devices", "--json")
    assert report == {"code": 0, "torch": False}, result.stderr
    data = json.loads(result.stdout)
    assert data["torch"] == {
        "version": "2.99.0+cu124",
        "cuda": "12.4",
        "cuda_usable": True,
        "cuda_unavailable_reason": None,
    }
    gpus = [d for d in data["devices"] if d["kind"] == "cuda"]
    assert [(d["spec"], d["nvml_index"]) for d in gpus] == [
        ("cuda:0", 0),
        ("cuda:1", 1),
        ("cuda:2", 2),
    ]
    assert gpus[0]["allocated_bytes"] is None  # this process never started CUDA
    assert data["devices"][-1]["kind"] == "cpu"


def test_devices_table_follows_visible_devices_without_torch(cuda_machine: Path) -> None:
    result, report = run(
        cuda_machine, CHILD, "devices", CUDA_VISIBLE_DEVICES="GPU-2222", COLUMNS="200"
    )
    assert report == {"code": 0, "torch": False}, result.stderr
    assert "NVIDIA GeForce GTX 1080" in result.stdout and "A100" not in result.stdout
    assert "CUDA_VISIBLE_DEVICES=GPU-2222" in result.stdout


def test_select_without_torch(cuda_machine: Path) -> None:
    result, report = run(cuda_machine, CHILD, "select", "-n", "2")
    assert report == {"code": 0, "torch": False}, result.stderr
    assert result.stdout == "0,1\n"
    result, report = run(cuda_machine, CHILD, "select", "-n", "1", "--min-free", "61GiB")
    assert report == {"code": 3, "torch": False}
    assert "only 0 of 3 qualify" in result.stderr


def test_watch_refreshes_without_importing_again(cuda_machine: Path) -> None:
    result, report = run(cuda_machine, WATCH_CHILD)
    assert report == {"code": 0, "torch": False, "new": []}, result.stderr
    assert len(result.stdout.splitlines()) == 3


def test_cpu_only_machine_answers_without_torch(tmp_path: Path) -> None:
    """No NVML, CPU-only torch: "no GPU" and the CPU row need no torch either."""
    root = fake_install(tmp_path, cuda=None, nvml=False)
    result, report = run(root, CHILD, "devices", COLUMNS="200")
    assert report == {"code": 0, "torch": False}, result.stderr
    assert "No CUDA GPU: this torch (2.99.0+cpu) is a CPU-only build" in result.stdout
    assert "cores)" in result.stdout  # the CPU row
    result, report = run(root, CHILD, "select", "-n", "1")
    assert report == {"code": 3, "torch": False}
    assert "none is visible" in result.stderr and result.stdout == ""


def test_env_json_without_torch_on_a_cpu_build(tmp_path: Path) -> None:
    """A CPU-only build has no cuDNN or NCCL, so torch is not needed to say so. (A CUDA
    build imports torch for those two versions: only the loaded libraries know them.)"""
    root = fake_install(tmp_path, cuda=None, nvml=True)
    result, report = run(root, CHILD, "env", "--json")
    assert report == {"code": 0, "torch": False}, result.stderr
    data = json.loads(result.stdout)
    versions = data["versions"]
    assert versions["torch"] == "2.99.0+cpu" and versions["torch CUDA"] is None
    assert versions["cuDNN"] is None and versions["NCCL"] is None
    assert versions["driver"] == "550.54.15" and len(data["gpus"]) == 3
    assert data["torch_device_count"] == 0  # a CPU build counts no GPU


def test_env_counts_gpus_through_nvml_on_a_cuda_build(cuda_machine: Path) -> None:
    result, report = run(cuda_machine, CHILD, "env", "--json")
    assert report["code"] == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["torch_device_count"] == 3
    # torch (unimportable here) was asked for cuDNN and NCCL only, and failed quietly
    assert data["versions"]["cuDNN"] is None and data["versions"]["NCCL"] is None


def test_import_torchgpu_does_not_import_torch(cuda_machine: Path) -> None:
    code = (
        "import json, sys, torchgpu, torchgpu.devices, torchgpu.cli.main\n"
        "print(json.dumps({'code': 0, 'torch': 'torch' in sys.modules}), file=sys.stderr)"
    )
    result, report = run(cuda_machine, code)
    assert report == {"code": 0, "torch": False}, result.stderr


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["devices", "--json"]])
def test_entry_point_does_not_import_torch(cuda_machine: Path, argv: list[str]) -> None:
    """``python -m torchgpu`` (``__main__`` -> ``cli.main``): importing torch would fail."""
    result = python(cuda_machine, "-m", "torchgpu", *argv)
    assert result.returncode == 0, result.stderr
    assert "torch was imported" not in result.stderr
