"""Real-GPU checks of the device layer (skipped without CUDA)."""

from __future__ import annotations

import time

import pytest
import torch

from torchgpu import devices
from torchgpu.transfer import Prefetcher, pin, to_device

pytestmark = pytest.mark.gpu


def test_get_device_and_list_devices_match_torch():
    assert devices.get_device("auto") == torch.device("cuda", 0)
    gpus = [d for d in devices.list_devices() if d.kind == "cuda"]
    assert len(gpus) == torch.cuda.device_count()
    for info in gpus:
        assert info.name == torch.cuda.get_device_name(info.index) or info.name.startswith(
            torch.cuda.get_device_name(info.index)
        )


def test_mem_get_info_vs_nvml():
    gpus = [d for d in devices.list_devices() if d.kind == "cuda"]
    for info in gpus:
        free, total = torch.cuda.mem_get_info(info.index)
        if info.total_bytes is None:
            pytest.skip("NVML not available")
        assert abs(info.total_bytes - total) <= 0.02 * total
        # free memory moves (this process's context appeared since NVML was read)
        fresh = next(d for d in devices.list_devices() if d.index == info.index)
        assert abs((fresh.free_bytes or 0) - free) <= 0.05 * total


def test_uuid_mapping_matches_torch_properties():
    props = torch.cuda.get_device_properties(0)
    info = next(d for d in devices.list_devices() if d.index == 0)
    if info.uuid is None or not getattr(props, "uuid", None):
        pytest.skip("uuid unknown")
    assert info.uuid.replace("GPU-", "") == str(props.uuid)


def test_pinned_copies_round_trip():
    x = torch.randn(1 << 20)
    p = pin(x)
    assert p.is_pinned()
    on_gpu = to_device({"x": p}, "cuda:0")["x"]
    back = to_device(on_gpu * 2, "cpu", non_blocking=True)  # synchronised before return
    assert torch.equal(back, x * 2)


def test_prefetcher_yields_correct_batches_and_overlaps():
    data = [torch.full((4096, 1024), float(i)) for i in range(8)]
    weight = torch.randn(1024, 1024, device="cuda")

    def run(loader):
        torch.cuda.synchronize()
        start = time.perf_counter()
        total = torch.zeros((), device="cuda")
        for batch in loader:
            for _ in range(4):
                batch = batch @ weight
            total += batch.sum()
        torch.cuda.synchronize()
        return time.perf_counter() - start, total

    plain = [to_device(d, "cuda:0") for d in data[:1]]  # warm-up
    del plain
    naive_s, naive_total = run(to_device(d, "cuda:0") for d in data)
    pre_s, pre_total = run(Prefetcher(data, "cuda:0"))
    torch.testing.assert_close(pre_total, naive_total, rtol=1e-3, atol=1e-3)
    assert len(Prefetcher(data, "cuda:0")) == 8
    assert pre_s < naive_s * 1.5  # overlap must not make it slower (timing is noisy)
