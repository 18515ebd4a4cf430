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


def _gpu_ms(fn, repeat=5):
    """Mean GPU time of ``fn`` in milliseconds, measured with CUDA events."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeat


def test_prefetcher_overlaps_copy_with_compute():
    """With copy time comparable to compute time, the naive loop pays for both (the copy
    and the kernels share one stream) while the Prefetcher hides the copies behind the
    kernels: it must be clearly faster, not merely "not much slower"."""
    n, size, rows = 8, 4096, 512
    # pinned sources: both loops copy asynchronously, so only the overlap differs
    data = [pin(torch.full((size, size), float(i))) for i in range(n)]
    weight = torch.randn(size, size, device="cuda") / size
    on_gpu = data[0].to("cuda:0")
    copy_ms = _gpu_ms(lambda: data[0].to("cuda:0", non_blocking=True))
    unit_ms = _gpu_ms(lambda: on_gpu[:rows] @ weight)
    # compute per batch ~ copy per batch, to within one unit (1/8 of a full matmul)
    reps = max(1, round(copy_ms / unit_ms))

    def run(loader):
        torch.cuda.synchronize()
        start = time.perf_counter()
        total = torch.zeros((), device="cuda")
        for batch in loader:
            for r in range(reps):
                start_row = (r * rows) % size
                total += (batch[start_row : start_row + rows] @ weight).sum()
        torch.cuda.synchronize()
        return time.perf_counter() - start, total

    def naive():
        return (to_device(d, "cuda:0") for d in data)  # pinned: async, on the compute stream

    run(naive())  # warm-up: cuBLAS, the caching allocator
    run(Prefetcher(data, "cuda:0"))
    naive_s, naive_total = min((run(naive()) for _ in range(3)), key=lambda r: r[0])
    pre_s, pre_total = min((run(Prefetcher(data, "cuda:0")) for _ in range(3)), key=lambda r: r[0])
    torch.testing.assert_close(pre_total, naive_total, rtol=1e-3, atol=1e-3)
    assert len(Prefetcher(data, "cuda:0")) == n
    # Serial: n * (copy + compute); overlapped: about copy + n * max(copy, compute),
    # i.e. ~0.56 of serial here. 0.8 leaves room for noise but fails without overlap.
    assert pre_s < 0.8 * naive_s, (
        f"no overlap: prefetcher {pre_s * 1e3:.1f} ms vs naive {naive_s * 1e3:.1f} ms "
        f"(copy {copy_ms:.2f} ms, compute {unit_ms:.2f} ms x {reps} per batch)"
    )


def test_packed_sequence_to_gpu_feeds_an_lstm():
    from torch.nn.utils.rnn import pack_padded_sequence

    packed = pack_padded_sequence(
        torch.randn(5, 3, 4), torch.tensor([5, 2, 3]), enforce_sorted=False
    )
    lstm = torch.nn.LSTM(4, 6).cuda()
    moved = to_device(packed, "cuda:0")
    assert moved.data.is_cuda and moved.sorted_indices.is_cuda
    assert moved.batch_sizes.device.type == "cpu"
    out, _ = lstm(moved)
    assert out.data.shape == (10, 6)
