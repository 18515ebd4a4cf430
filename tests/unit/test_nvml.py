"""The NVML reader degrades, never crashes: NotSupported -> None, lost GPU -> error."""

from __future__ import annotations

import sys

import pytest

from tests.nvml_fake import GIB, fake_backend, make_pynvml
from torchgpu.devices import nvml


def test_reads_full_gpu():
    inv = fake_backend().read()
    assert inv.available and inv.error is None
    assert inv.driver_version == "550.54.15"
    assert inv.nvml_version == "12.550.54.15"  # bytes decoded
    assert inv.cuda_driver_version == "12.4"
    gpu = inv.gpus[0]
    assert gpu.name == "NVIDIA A100-SXM4-80GB"
    assert gpu.pci_bus_id == "00000000:07:00.0"
    assert (gpu.total_bytes, gpu.free_bytes, gpu.used_bytes) == (80 * GIB, 60 * GIB, 20 * GIB)
    assert gpu.compute_capability == (8, 0)
    assert gpu.utilization_pct == 35 and gpu.temperature_c == 41
    assert gpu.power_w == pytest.approx(95.5) and gpu.power_limit_w == pytest.approx(400.0)
    assert gpu.mig_enabled is False
    assert gpu.processes == (nvml.GpuProcess(4242, "python", "alice", 19 * GIB),)
    assert gpu.error is None


def test_not_supported_fields_are_none():
    gpu = fake_backend().read().gpus[1]
    assert gpu.error is None
    assert gpu.name == "NVIDIA GeForce GTX 1080" and gpu.temperature_c == 30
    assert gpu.utilization_pct is None and gpu.power_w is None and gpu.power_limit_w is None
    assert gpu.mig_enabled is None and gpu.processes is None


def test_lost_gpu_is_listed_with_error():
    gpu = fake_backend().read().gpus[2]
    assert gpu.error == "GPU is lost"
    assert gpu.uuid is not None and gpu.name == "NVIDIA A100-SXM4-80GB"
    assert gpu.total_bytes is None


def test_init_failure_gives_reason_and_no_gpus():
    module = make_pynvml(init_error=9)
    inv = nvml.PynvmlBackend(module=module).read()
    assert not inv.available and inv.gpus == ()
    assert "NVML unavailable" in (inv.error or "")


def test_shutdown_balances_init():
    module = make_pynvml()
    nvml.PynvmlBackend(module=module).read()
    assert module.calls == {"init": 1, "shutdown": 1}


def test_missing_pynvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    inv = nvml.PynvmlBackend().read()
    assert not inv.available and "nvidia-ml-py" in (inv.error or "")


def test_real_library_absent_here_does_not_raise():
    inv = nvml.PynvmlBackend().read()
    assert isinstance(inv, nvml.NvmlInventory)
    assert inv.available or inv.error


def test_backend_swap_and_broken_backend():
    class Broken:
        def read(self):
            raise RuntimeError("boom")

    fixed = nvml.NvmlInventory(driver_version="1")
    with nvml.use_backend(nvml.StaticBackend(fixed)):
        assert nvml.read_inventory() is fixed
        with nvml.use_backend(Broken()):
            assert "boom" in (nvml.read_inventory().error or "")
        assert nvml.read_inventory() is fixed
    assert nvml.read_inventory() is not fixed


def test_process_identity_of_self():
    import os

    name, _user = nvml.process_identity(os.getpid())
    assert name  # /proc/self/comm exists on Linux
    assert nvml.process_identity(2**22 + 12345) == (None, None)


def test_mig_devices_read():
    gpus = [
        {
            "uuid": "GPU-m",
            "name": "NVIDIA A100",
            "mig": (1, 1),
            "memory": type("M", (), {"total": 40, "free": 30, "used": 10})(),
        }
    ]
    module = make_pynvml(gpus=gpus)
    module.nvmlDeviceGetMaxMigDeviceCount = lambda h: 2
    mig_memory = type("M", (), {"total": 10, "free": 8, "used": 2})()

    def mig_handle(h, slot):
        if slot == 1:
            raise module.NVMLError(6)  # empty slot: Not Found
        return ("mig", slot)

    module.nvmlDeviceGetMigDeviceHandleByIndex = mig_handle
    real_uuid, real_name, real_mem = (
        module.nvmlDeviceGetUUID,
        module.nvmlDeviceGetName,
        module.nvmlDeviceGetMemoryInfo,
    )
    module.nvmlDeviceGetUUID = lambda h: "MIG-abc" if isinstance(h, tuple) else real_uuid(h)
    module.nvmlDeviceGetName = lambda h: "1g.10gb" if isinstance(h, tuple) else real_name(h)
    module.nvmlDeviceGetMemoryInfo = lambda h: mig_memory if isinstance(h, tuple) else real_mem(h)
    gpu = nvml.PynvmlBackend(module=module).read().gpus[0]
    assert gpu.mig_enabled is True
    assert [(m.uuid, m.name, m.total_bytes) for m in gpu.mig_devices] == [
        ("MIG-abc", "1g.10gb", 10)
    ]
