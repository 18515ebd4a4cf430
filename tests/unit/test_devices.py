"""get_device, list_devices, select_devices, set_visible_devices, default_device, sizes.

A fake NVML (tests/nvml_fake.py) and patched torch.cuda counts stand in for GPUs;
torch.cuda._lazy_init is made to fail so any CUDA initialisation would show.
"""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

from tests.nvml_fake import GIB, fake_backend
from torchgpu import devices
from torchgpu.devices import cuda_status, nvml, spec, torch_build
from torchgpu.devices import host as host_module
from torchgpu.errors import DeviceSpecError, NoDeviceError, UsageError, VisibleDevicesError

VARS = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "TORCHGPU_DEVICE", "LOCAL_RANK")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in VARS:
        monkeypatch.delenv(name, raising=False)

    def no_init(*_a, **_k):
        raise AssertionError("CUDA was initialised")

    monkeypatch.setattr(torch.cuda, "_lazy_init", no_init)
    monkeypatch.setattr(cuda_status, "_driver_read", None)  # no count through the driver yet
    with nvml.use_backend(nvml.StaticBackend(nvml.NvmlInventory(error="no NVML in tests"))):
        yield


@pytest.fixture
def fake_gpus(monkeypatch):
    """Three NVML GPUs, a CUDA build of torch that sees as many as the variables allow."""
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(devices.list_devices()) - 1)
    with nvml.use_backend(fake_backend()):
        yield


def cuda_build(monkeypatch, count):
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.fixture
def cpu_build(monkeypatch):
    """A CPU-only build of torch and no GPU, whatever this machine has: these tests check
    what a CPU-only machine is told, and must say the same on the GPU check's machine."""
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# (ids avoid the word "gpu": the gpu-marker skip in conftest matches keywords)
@pytest.mark.parametrize(
    "spec",
    [
        "gpu",
        "CUDA:0",
        "",
        "cuda: 0",
        "cuda:-1",
        "tpu",
        " cpu",
        "cuda:01",
        "Cuda",
        "cuda:0:1",
        "-1",
        "1.0",
        "cpu:0",
    ],
    ids=lambda s: f"spec-{s!r}".replace("gpu", "g-p-u"),
)
def test_bad_specs_list_accepted_forms(spec):
    with pytest.raises(DeviceSpecError) as info:
        devices.get_device(spec)
    message = str(info.value)
    assert repr(spec) in message
    assert "auto, cpu, cuda, cuda:N" in message


@pytest.mark.parametrize("spec", [-1, True, 1.0, None, torch.device("meta")])
def test_bad_spec_objects(spec):
    with pytest.raises(DeviceSpecError):
        devices.get_device(spec)


def test_bad_spec_is_value_error_with_exit_2():
    with pytest.raises(ValueError) as info:
        devices.get_device("gpu")
    assert info.value.exit_code == 2


@pytest.mark.parametrize("spec", ["cpu", torch.device("cpu"), "auto"])
def test_cpu_specs_on_cpu_machine(spec, cpu_build):
    assert devices.get_device(spec) == torch.device("cpu")


@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "0", 0, torch.device("cuda", 0)])
def test_cuda_on_cpu_build_says_why(spec, cpu_build):
    with pytest.raises(NoDeviceError) as info:
        devices.get_device(spec)
    message = str(info.value)
    assert "CPU-only build" in message and "torch.version.cuda is None" in message
    assert info.value.exit_code == 3


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("cuda", "cuda:0"),
        ("cuda:1", "cuda:1"),
        ("1", "cuda:1"),
        (1, "cuda:1"),
        (torch.device("cuda", 1), "cuda:1"),
        (torch.device("cuda"), "cuda:0"),
        ("auto", "cuda:0"),
    ],
)
def test_cuda_specs_with_two_gpus(monkeypatch, spec, expected):
    cuda_build(monkeypatch, 2)
    assert devices.get_device(spec) == torch.device(expected)


def test_index_out_of_range_names_numbers(monkeypatch):
    cuda_build(monkeypatch, 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,2")
    with pytest.raises(DeviceSpecError) as info:
        devices.get_device("cuda:3")
    message = str(info.value)
    assert "cuda:3 requested but 2 GPUs are visible (CUDA_VISIBLE_DEVICES=1,2)" in message
    assert "cuda:0..cuda:1" in message and "--device cpu" in message


def test_auto_honours_local_rank_and_override(monkeypatch):
    cuda_build(monkeypatch, 4)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert devices.get_device() == torch.device("cuda", 3)
    assert devices.get_device("cuda") == torch.device("cuda", 3)
    monkeypatch.setenv("TORCHGPU_DEVICE", "cpu")
    assert devices.get_device("auto") == torch.device("cpu")
    monkeypatch.setenv("TORCHGPU_DEVICE", "gpu0")
    with pytest.raises(DeviceSpecError, match="TORCHGPU_DEVICE='gpu0'"):
        devices.get_device()


def test_auto_override_names_the_variable_when_cuda_is_unusable(monkeypatch, cpu_build):
    monkeypatch.setenv("TORCHGPU_DEVICE", "cuda:0")  # this torch is a CPU-only build
    with pytest.raises(NoDeviceError) as info:
        devices.get_device()
    message = str(info.value)
    assert message.startswith("TORCHGPU_DEVICE='cuda:0': cuda:0 requested but CUDA cannot")
    assert message.endswith("; unset TORCHGPU_DEVICE or set it to cpu")
    assert info.value.exit_code == 3
    cuda_build(monkeypatch, 2)
    monkeypatch.setenv("TORCHGPU_DEVICE", "cuda:2")
    with pytest.raises(DeviceSpecError, match=r"^TORCHGPU_DEVICE='cuda:2': cuda:2 requested"):
        devices.get_device("auto")


def test_auto_local_rank_beyond_gpus(monkeypatch):
    cuda_build(monkeypatch, 2)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(NoDeviceError, match="LOCAL_RANK=2 but 2 GPU"):
        devices.get_device()


def test_visible_devices_hiding_all_is_the_reason(monkeypatch):
    cuda_build(monkeypatch, 0)
    for value in ("", "-1", "0,0"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
        reason = devices.cuda_unavailable_reason()
        assert f"CUDA_VISIBLE_DEVICES={value!r} hides every GPU" in reason


def test_no_driver_reason(monkeypatch):
    cuda_build(monkeypatch, 0)
    monkeypatch.setattr(cuda_status, "driver_evidence", lambda inventory=None: None)
    assert "no NVIDIA driver" in devices.cuda_unavailable_reason()


def test_cpu_build_with_driver_reason(monkeypatch, cpu_build):
    with nvml.use_backend(fake_backend()):
        reason = devices.cuda_unavailable_reason()
    assert "CPU-only build" in reason and "NVML lists 3 GPU(s)" in reason


def test_usable_cuda_has_empty_reason(monkeypatch):
    cuda_build(monkeypatch, 1)
    assert devices.cuda_unavailable_reason() == ""


def test_mps_unavailable_says_why(monkeypatch):
    monkeypatch.setattr(spec, "mps_available", lambda: False)
    with pytest.raises(NoDeviceError, match="Metal"):
        devices.get_device("mps")


# ------------------------------------------------------------------ list_devices
def test_list_devices_cpu_only(cpu_build):
    found = devices.list_devices()
    assert [d.kind for d in found] == ["cpu"]
    cpu = found[0]
    assert cpu.spec == "cpu" and cpu.cores and cpu.cores >= 1
    assert cpu.total_bytes and cpu.free_bytes and 0 < cpu.free_bytes <= cpu.total_bytes


def test_host_info_agrees_with_the_cpu_entry():
    host = host_module.host_info()
    assert host.cpu_name and host.cores == os.cpu_count()
    if host.total_bytes is not None:  # Linux: /proc/meminfo
        assert host.available_bytes is not None and 0 < host.available_bytes <= host.total_bytes
        assert host.total_bytes == host_module.meminfo()["MemTotal"]
    cpu = devices.cpu_device_info()
    assert (cpu.name, cpu.cores, cpu.total_bytes) == (host.cpu_name, host.cores, host.total_bytes)


def test_list_devices_from_fake_nvml(fake_gpus):
    found = devices.list_devices()
    assert [d.spec for d in found] == ["cuda:0", "cuda:1", "cuda:2", "cpu"]
    # FASTEST_FIRST: the A100 (cc 8.0) before the GTX 1080 (6.1); the lost GPU (capability
    # unknown) last
    assert [d.nvml_index for d in found[:3]] == [0, 1, 2]
    assert [d.cuda_ordinal for d in found[:3]] == [0, 1, 2]
    a100, gtx, lost = found[:3]
    assert a100.bf16_supported is True and gtx.bf16_supported is False
    assert a100.free_bytes == 60 * GIB and a100.processes[0].user == "alice"
    assert gtx.utilization_pct is None and gtx.processes is None
    assert lost.error == "GPU is lost" and lost.total_bytes is None
    assert a100.allocated_bytes is None  # CUDA not initialised in this process


@pytest.mark.parametrize(
    ("visible", "order", "nvml_indices"),
    [
        (None, "PCI_BUS_ID", [0, 1, 2]),
        ("1", "PCI_BUS_ID", [1]),
        ("2", "PCI_BUS_ID", [2]),
        ("0", None, [0]),
        ("2,0", "PCI_BUS_ID", [2, 0]),
        ("GPU-2222", None, [1]),
        ("GPU-33333333-aaaa-bbbb-cccc-000000000000,GPU-1", None, [2, 0]),
        ("0,,1", "PCI_BUS_ID", [0]),
        ("0,9,1", "PCI_BUS_ID", [0]),
        ("", None, []),
    ],
)
def test_list_devices_maps_visible_devices(monkeypatch, fake_gpus, visible, order, nvml_indices):
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    if order is not None:
        monkeypatch.setenv("CUDA_DEVICE_ORDER", order)
    gpus = [d for d in devices.list_devices() if d.kind == "cuda"]
    assert [d.nvml_index for d in gpus] == nvml_indices
    assert [d.index for d in gpus] == list(range(len(nvml_indices)))


# ---------------------------------------------------------------- select_devices
@pytest.mark.parametrize(
    ("n", "min_free", "max_util", "expected"),
    [
        (1, None, None, [0]),  # most free: A100 with 60 GiB
        (2, None, None, [0, 1]),  # then the GTX (7 GiB); the lost one has no free figure
        (1, "8GiB", None, [0]),
        (1, 7 * GIB, None, [0]),
        (1, None, 50, [0]),
    ],
)
def test_select_devices(monkeypatch, fake_gpus, n, min_free, max_util, expected):
    # ids are CUDA ordinals (FASTEST_FIRST): A100 -> 0, GTX -> 1, lost A100 -> 2
    assert devices.select_devices(n, min_free=min_free, max_util=max_util) == expected


def test_select_devices_not_enough(fake_gpus):
    with pytest.raises(NoDeviceError) as info:
        devices.select_devices(2, min_free="8GiB")
    message = str(info.value)
    assert "only 1 of 3 qualify" in message
    assert "cuda:2 cannot be read (GPU is lost)" in message
    assert "cuda:1 has 7.0 GiB free < 8.0 GiB" in message
    with pytest.raises(NoDeviceError, match="unknown utilisation"):
        devices.select_devices(2, max_util=90)


def test_select_devices_none_visible(cpu_build):
    with pytest.raises(NoDeviceError, match="none is visible"):
        devices.select_devices(1)


@pytest.mark.parametrize("args", [(0,), (-1,), (True,), (1, "lots"), (1, None, 101)])
def test_select_devices_bad_arguments(args):
    with pytest.raises(UsageError):
        devices.select_devices(*args)


# ---------------------------------------------------------- set_visible_devices
@pytest.mark.parametrize(("ids", "expected"), [("1,2", "1,2"), ([0, 3], "0,3"), ("", "")])
def test_set_visible_devices(monkeypatch, ids, expected):
    assert devices.set_visible_devices(ids) == expected
    assert os.environ["CUDA_VISIBLE_DEVICES"] == expected


@pytest.mark.parametrize("ids", ["0,,1", "0,0", "x", [1, 1], "-1"])
def test_set_visible_devices_refuses_garbage(monkeypatch, ids):
    with pytest.raises(VisibleDevicesError) as info:
        devices.set_visible_devices(ids)
    assert "CUDA_VISIBLE_DEVICES" in str(info.value)
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_set_visible_devices_checks_count(fake_gpus):
    with pytest.raises(VisibleDevicesError, match="names GPU 5 but this machine has 3"):
        devices.set_visible_devices("0,5")


def test_set_visible_devices_refuses_after_init(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(VisibleDevicesError, match="already initialised"):
        devices.set_visible_devices("0")


def driver_counts(monkeypatch, nvml_count, gpus=2):
    """A CUDA build whose NVML count is ``nvml_count`` (< 0: torch asks the driver)."""
    cuda_build(monkeypatch, gpus)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: gpus, raising=False)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: nvml_count, raising=False)


def test_set_visible_devices_warns_when_the_driver_already_read_it(monkeypatch):
    driver_counts(monkeypatch, nvml_count=-1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert devices.get_device() == torch.device("cuda", 0)
    assert cuda_status.driver_read_visible_devices() == (True, "0,1")
    with pytest.warns(RuntimeWarning, match="child processes only.*already read it as '0,1'"):
        assert devices.set_visible_devices("1") == "1"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"  # still set, for child processes
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        devices.set_visible_devices("0,1")  # what the driver read: nothing to warn about


def test_set_visible_devices_quiet_when_nvml_counted(monkeypatch):
    driver_counts(monkeypatch, nvml_count=2)
    devices.get_device()
    devices.list_devices()
    assert cuda_status.driver_read_visible_devices() == (False, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert devices.set_visible_devices("1") == "1"


def test_mig_ids_always_count_through_the_driver(monkeypatch):
    def nvml_not_asked():
        raise AssertionError("torch skips NVML for MIG ids")

    driver_counts(monkeypatch, nvml_count=2)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", nvml_not_asked)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-abc")
    assert cuda_status.cuda_device_count() == 2
    assert cuda_status.driver_read_visible_devices() == (True, "MIG-abc")
    with pytest.warns(RuntimeWarning, match="child processes only"):
        devices.set_visible_devices("MIG-def")


@pytest.mark.parametrize("case", ["cpu-build", "no-driver", "cuda-initialised"])
def test_count_not_through_driver(monkeypatch, case):
    driver_counts(monkeypatch, nvml_count=-1, gpus=0 if case == "no-driver" else 2)
    if case == "cpu-build":
        monkeypatch.delattr(torch._C, "_cuda_getDeviceCount", raising=False)
    if case == "no-driver":
        monkeypatch.setattr(cuda_status, "driver_evidence", lambda inventory=None: None)
    if case == "cuda-initialised":
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    cuda_status.cuda_device_count()
    assert cuda_status.driver_read_visible_devices() == (False, None)


# ------------------------------------------------------- torch build, CUDA started
VERSION_PY = (
    "from typing import Optional\n\n__version__ = '2.13.0+cu126'\ndebug = False\n"
    "cuda: Optional[str] = '12.6'\ngit_version = 'abc'\nhip: Optional[str] = None\n"
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (VERSION_PY, torch_build.TorchBuild("2.13.0+cu126", "12.6", None)),
        ("__version__ = '2.13.0+cpu'\ncuda = None\nhip = None\n",
         torch_build.TorchBuild("2.13.0+cpu", None, None)),
        ("__version__ = '2.5.0+rocm6.2'\ncuda = None\nhip = '6.2.1'\n",
         torch_build.TorchBuild("2.5.0+rocm6.2", None, "6.2.1")),
        ("cuda = '12.6'\n", None),  # no version: not a torch/version.py we understand
        ("__version__ = compute()\n", None),
        ("__version__ = '2.0'\ncuda = 12\n", None),
        ("def broken(:\n", None),
    ],
)
def test_torch_build_from_version_file(tmp_path, text, expected):
    path = tmp_path / "version.py"
    path.write_text(text)
    assert torch_build._from_file(path) == expected


def test_torch_build_asks_torch_once_imported(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    build = torch_build.torch_build()
    assert (build.version, build.cuda, build.hip) == (str(torch.__version__), "12.4", None)
    assert not build.cpu_only


def test_torch_build_file_agrees_with_torch():
    """The installed torch's version.py says what torch.version says."""
    import importlib.util
    from pathlib import Path

    spec_ = importlib.util.find_spec("torch")
    path = Path(next(iter(spec_.submodule_search_locations))) / "version.py"
    found = torch_build._from_file(path)
    assert found == torch_build.TorchBuild(str(torch.__version__), torch.version.cuda,
                                           torch.version.hip)


def test_cuda_initialized_never_imports_torch(monkeypatch):
    assert cuda_status.cuda_initialized() is False
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert cuda_status.cuda_initialized() is True
    monkeypatch.delitem(sys.modules, "torch")  # a process that never imported torch
    assert cuda_status.cuda_initialized() is False
    assert "torch" not in sys.modules


def test_mps_needs_macos(monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    assert torch_build.mps_available() is False


# ---------------------------------------------------------------- default_device
def test_default_device_restores_previous():
    before = torch.get_default_device()
    with devices.default_device("cpu") as dev:
        assert dev == torch.device("cpu")
        with torch.device("meta"):
            with devices.default_device("cpu"):
                assert torch.empty(1).device.type == "cpu"
            assert torch.empty(1).device.type == "meta"
    assert torch.get_default_device() == before


def test_default_device_restores_on_error():
    with torch.device("meta"):
        with pytest.raises(RuntimeError), devices.default_device("cpu"):
            raise RuntimeError("inside")
        assert torch.empty(1).device.type == "meta"


def test_default_device_validates():
    with pytest.raises(DeviceSpecError), devices.default_device("gpu"):
        pass


# ------------------------------------------------------------------------- sizes
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1024", 1024),
        ("0", 0),
        ("8GiB", 8 << 30),
        ("8G", 8 << 30),
        ("8gib", 8 << 30),
        ("500MB", 500_000_000),
        ("500mb", 500_000_000),
        ("1.5KiB", 1536),
        ("2 TB", 2 * 10**12),
        ("12B", 12),
        ("3Ki", 3072),
        (" 1MiB ", 1 << 20),
    ],
)
def test_parse_size(text, expected):
    assert devices.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "-1GB", "8 GiBs", "1e3", "8XB", "1,5GB", "ib"])
def test_parse_size_refuses(text):
    with pytest.raises(UsageError) as info:
        devices.parse_size(text)
    assert repr(text) in str(info.value) and "8GiB" in str(info.value)


@pytest.mark.parametrize(
    ("n", "text"),
    [(None, "-"), (0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (80 * GIB, "80.0 GiB")],
)
def test_format_bytes(n, text):
    assert devices.format_bytes(n) == text
