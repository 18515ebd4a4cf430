"""`torchgpu env` and `torchgpu doctor`: findings table-driven over snapshots, exit codes,
--model resolution and the placement hand-off."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch
from torch import nn

from tests.nvml_fake import fake_inventory
from tests.procs import run_cli
from torchgpu.cli import doctor
from torchgpu.cli.env import format_report, variables
from torchgpu.cli.main import main
from torchgpu.devices import nvml

GIB = 1 << 30
A100 = nvml.NvmlGpu(
    0,
    uuid="GPU-a",
    name="A100",
    total_bytes=80 * GIB,
    used_bytes=GIB,
    compute_capability=(8, 0),
    processes=(),
)
A100_2 = dataclasses.replace(A100, nvml_index=1, uuid="GPU-b")
T4 = nvml.NvmlGpu(
    1,
    uuid="GPU-t",
    name="T4",
    total_bytes=16 * GIB,
    used_bytes=GIB,
    compute_capability=(7, 5),
    processes=(),
)
CLEAN = doctor.EnvSnapshot(
    torch_version="2.13.0",
    torch_cuda="12.4",
    nccl_available=True,
    torch_device_count=2,
    inventory=nvml.NvmlInventory(gpus=(A100, A100_2), cuda_driver_version="12.4"),
    driver_evidence="NVML",
)


def snap(**changes):
    return dataclasses.replace(CLEAN, **changes)


def inv(*gpus, **kw):
    return nvml.NvmlInventory(gpus=gpus, **kw)


@pytest.mark.parametrize(
    ("snapshot", "codes", "text"),
    [
        (CLEAN, [], ""),
        (snap(cuda_visible_devices="0,1"), [], ""),
        (snap(cuda_visible_devices=""), [], ""),  # deliberate: hide all
        (snap(cuda_visible_devices="-1"), [], ""),
        (snap(cuda_visible_devices="0 1"), ["visible-devices"], "CUDA_VISIBLE_DEVICES=0,1"),
        (snap(cuda_visible_devices="0;1"), ["visible-devices"], "read by the driver as '0'"),
        (snap(cuda_visible_devices="0,0"), ["visible-devices"], "twice"),
        (snap(cuda_visible_devices="0,5,1"), ["visible-devices"], "GPU 5 does not exist"),
        (snap(cuda_visible_devices="all"), ["visible-devices"], "unset CUDA_VISIBLE_DEVICES"),
        (snap(cuda_visible_devices="GPU-zzz"), ["visible-devices"], "matches no GPU"),
        (snap(cuda_visible_devices="GPU-b"), [], ""),
        # mixed kinds: the suggestion keeps the first token's kind, converting the rest
        # through the inventory (cuda ordinal 0 is GPU-a) and dropping repeats
        (snap(cuda_visible_devices="GPU-b,0"), ["visible-devices"], "=GPU-b,GPU-a ("),
        (snap(cuda_visible_devices="0,GPU-b"), ["visible-devices"], "=0,1 ("),
        (snap(cuda_visible_devices="GPU-b,1"), ["visible-devices"], "=GPU-b ("),
        (snap(cuda_visible_devices="1,GPU-b,0"), ["visible-devices"], "=1,0 ("),
        (
            snap(inventory=inv(cuda_driver_version="12.4"), cuda_visible_devices="GPU-2222,0"),
            ["visible-devices"],
            "export CUDA_VISIBLE_DEVICES=GPU-2222 (",  # no inventory: the ordinal is dropped
        ),
        (
            snap(
                inventory=inv(
                    dataclasses.replace(A100, mig_devices=(nvml.NvmlGpu(0, uuid="MIG-123"),)),
                    A100_2,
                ),
                cuda_visible_devices="MIG-123,1,GPU-b",
            ),
            ["visible-devices"],
            "export CUDA_VISIBLE_DEVICES=MIG-123 (",  # no whole-GPU id selects an instance
        ),
        (snap(inventory=inv(A100, T4)), ["device-order"], "CUDA_DEVICE_ORDER=PCI_BUS_ID"),
        (snap(inventory=inv(A100, T4), cuda_device_order="PCI_BUS_ID"), [], ""),
        (snap(torch_cuda=None, nccl_available=None), ["cpu-only-torch"], "CPU-only build"),
        (snap(torch_cuda=None, nccl_available=None, driver_evidence=None, inventory=inv()), [], ""),
        (snap(nccl_available=False), ["nccl-missing"], "without NCCL"),
        (
            snap(
                torch_cuda="12.4",
                torch_device_count=0,
                inventory=inv(A100, cuda_driver_version="11.8"),
            ),
            ["driver-too-old"],
            "11.8",
        ),
        (
            snap(inventory=inv(dataclasses.replace(A100, used_bytes=75 * GIB))),
            ["gpu-full"],
            "75.0 GiB of 80.0 GiB",
        ),
        (
            snap(
                inventory=inv(dataclasses.replace(A100, used_bytes=75 * GIB)),
                cuda_visible_devices="GPU-zz-other",
            ),
            ["visible-devices"],
            "",
        ),
        (
            snap(
                inventory=inv(
                    dataclasses.replace(
                        A100, processes=(nvml.GpuProcess(77, "python", "bob", GIB),)
                    )
                )
            ),
            ["gpu-busy"],
            "pid 77 python (bob",
        ),
        (
            snap(
                own_pids=frozenset({77}),
                inventory=inv(
                    dataclasses.replace(
                        A100, processes=(nvml.GpuProcess(77, "python", "bob", GIB),)
                    )
                ),
            ),
            [],
            "",
        ),
        (
            snap(
                inventory=inv(
                    dataclasses.replace(
                        A100, mig_enabled=True, mig_devices=(nvml.NvmlGpu(0, uuid="MIG-123"),)
                    )
                )
            ),
            ["mig"],
            "CUDA_VISIBLE_DEVICES=MIG-123",
        ),
        (
            snap(inventory=inv(A100, nvml.NvmlGpu(1, error="GPU is lost"))),
            ["gpu-unreadable"],
            "GPU is lost",
        ),
    ],
)
def test_find_problems(snapshot, codes, text):
    findings = doctor.find_problems(snapshot)
    assert [f.code for f in findings] == codes
    assert all(f.fix for f in findings)
    joined = " ".join(f"{f.message} {f.fix}" for f in findings)
    assert text in joined


def test_format_findings():
    s = snap(cuda_visible_devices="0 1", nccl_available=False)
    out = doctor.format_findings(doctor.find_problems(s), s)
    assert out.startswith("doctor: 2 problem(s) found\n1. [visible-devices]")
    assert "\n   fix: " in out and "\n2. [nccl-missing]" in out
    assert doctor.format_findings([], CLEAN).startswith("doctor: no problems found")


def test_doctor_exit_codes_in_process(monkeypatch, capsys):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    # a CPU-only torch beside the fake GPUs, whatever this machine's torch is (the GPU
    # check runs this file where torch is a CUDA build)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with nvml.use_backend(nvml.StaticBackend(fake_inventory())):
        assert main(["doctor"]) == 1  # CPU torch + GPUs, mixed GPUs, a lost GPU, a busy one
    out = capsys.readouterr().out
    for code in ("device-order", "cpu-only-torch", "gpu-unreadable", "gpu-busy"):
        assert f"[{code}]" in out
    monkeypatch.setattr(doctor, "take_snapshot", lambda: CLEAN)
    assert main(["doctor"]) == 0
    assert "no problems found" in capsys.readouterr().out


def test_env_report(monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,2")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("TORCH_LOGS", "+dynamo")
    monkeypatch.delenv("RANK", raising=False)
    with nvml.use_backend(nvml.StaticBackend(fake_inventory())):
        assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("```\n") and out.rstrip().endswith("```")
    for needle in (
        "python:",
        "torch:",
        "cuDNN:",
        "NCCL:",
        "driver:",
        "550.54.15",
        "NVML:",
        "CUDA_VISIBLE_DEVICES=1,2",
        "RANK=(unset)",
        "NCCL_DEBUG=INFO",
        "TORCH_LOGS=+dynamo",
        "MASTER_PORT=(unset)",
        "GPUs (NVML):",
        "2: NVIDIA A100",
    ):
        assert needle in out, needle
    assert str(torch.__version__) in out


def test_env_json_and_variables(capsys):
    assert main(["env", "--json"]) == 0
    import json

    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"versions", "gpus", "torch_device_count", "variables"}
    got = variables(
        {"NCCL_X": "1", "HOME": "/h", "PYTORCH_CUDA_ALLOC_CONF": "a", "LOCAL_RANK": "0"}
    )
    assert got["LOCAL_RANK"] == "0" and got["NCCL_X"] == "1" and "HOME" not in got
    assert list(got)[-2:] == ["NCCL_X", "PYTORCH_CUDA_ALLOC_CONF"]
    assert "WORLD_SIZE=(unset)" in format_report(
        {"versions": {"a": "b"}, "gpus": [], "torch_device_count": 0, "variables": got}
    )


class FakeReport:
    def __init__(self, ok):
        self.ok = ok
        self.problems = [] if ok else ["layer on cuda:0"]

    def format(self):
        return "placement ok" if self.ok else "placement: layer on cuda:0"


@pytest.mark.parametrize("ok", [True, False])
def test_doctor_model_hands_off_to_placement(monkeypatch, capsys, ok):
    calls = []
    fake = types.ModuleType("torchgpu.placement")
    fake.check_placement = lambda f, shape, devs: calls.append((f, shape, devs)) or FakeReport(ok)
    monkeypatch.setitem(sys.modules, "torchgpu.placement", fake)
    code = main(
        [
            "doctor",
            "--model",
            "torch.nn:Identity",
            "--input-shape",
            "2,3,8,8",
            "--devices",
            "cuda:0,cuda:1",
        ]
    )
    assert code == (0 if ok else 1)
    assert calls == [(nn.Identity, (2, 3, 8, 8), ["cuda:0", "cuda:1"])]
    assert capsys.readouterr().out.strip() == FakeReport(ok).format()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "torch.nn:Identity"], "--model needs --input-shape"),
        (["--model", "torch.nn:Identity", "--input-shape", "2,x"], "is not a shape"),
        (["--model", "torch.nn:Identity", "--input-shape", "0,3"], "is not a shape"),
        (
            ["--model", "torch.nn:Identity", "--input-shape", "2", "--devices", "cuda:0,"],
            "empty entry",
        ),
        (["--model", "nope", "--input-shape", "2"], "is not understood"),
        (["--input-shape", "2"], "go with --model"),
    ],
)
def test_doctor_model_usage_errors(capsys, argv, message):
    assert main(["doctor", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.slow
def test_doctor_and_env_subprocess():
    env = run_cli(["env"], timeout=60, CUDA_VISIBLE_DEVICES="0 1")
    assert env.returncode == 0 and "CUDA_VISIBLE_DEVICES=0 1" in env.stdout
    bad = run_cli(["doctor", "--model", "no_such_module_xyz:f", "--input-shape", "1"], timeout=60)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "no module named 'no_such_module_xyz'" in bad.stderr
