"""Batch-size search against a simulated memory limit: exact sizes, probe counts, agreement."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

from torchgpu.errors import ConfigError, OutOfMemoryBackoffError
from torchgpu.memory.batch_size_search import find_batch_size, keep_effective


def identity(value: int) -> int:
    return value


def nothing() -> None:
    """No garbage collection between probes: nothing real was allocated."""


def limited(
    limit_bytes: int, bytes_per_sample: int, calls: list[int] | None = None
) -> Callable[[int], None]:
    """try_step that runs out of memory when batch * bytes_per_sample > limit_bytes."""

    def try_step(batch: int) -> None:
        if calls is not None:
            calls.append(batch)
        if batch * bytes_per_sample > limit_bytes:
            raise torch.OutOfMemoryError(f"tried {batch * bytes_per_sample} bytes")

    return try_step


@pytest.mark.parametrize(
    ("limit_bytes", "bytes_per_sample", "start", "max_size"),
    [
        (1000, 10, 1, 65536),  # 100
        (1000, 10, 8, 65536),  # 100, start in the middle
        (1000, 10, 512, 65536),  # start above the answer: search below it
        (10, 10, 1, 65536),  # exactly 1
        (1024, 1, 1, 65536),  # a power of two
        (1023, 1, 1, 65536),  # just below one
        (10**9, 1, 1, 300),  # the cap
        (777, 3, 5, 1000),  # 259
    ],
)
def test_finds_exact_largest_size(
    limit_bytes: int, bytes_per_sample: int, start: int, max_size: int
) -> None:
    calls: list[int] = []
    result = find_batch_size(
        limited(limit_bytes, bytes_per_sample, calls),
        start=start,
        max_size=max_size,
        agree=identity,
        release=nothing,
    )
    expected = min(limit_bytes // bytes_per_sample, max_size)
    assert result.size == expected
    assert result.capped == (expected == max_size and limit_bytes // bytes_per_sample >= max_size)
    assert [p.size for p in result.probes] == calls
    fits = [p.size for p in result.probes if p.fits]
    fails = [p.size for p in result.probes if not p.fits]
    assert max(fits) == expected
    assert all(s > expected for s in fails)
    # grow + bisect: logarithmic number of probes
    assert len(calls) <= 2 * math.ceil(math.log2(max(expected, start) + 1)) + 3


def test_probe_sequence_is_grow_then_bisect() -> None:
    result = find_batch_size(limited(100, 1), start=16, agree=identity, release=nothing)
    assert [(p.size, p.fits) for p in result.probes] == [
        (16, True),
        (32, True),
        (64, True),
        (128, False),
        (96, True),
        (112, False),
        (104, False),
        (100, True),
        (102, False),
        (101, False),
    ]
    assert result.size == 100
    assert "100 ok" in result.describe() and "128 OOM" in result.describe()


def test_real_model_under_simulated_limit() -> None:
    """A real forward/backward whose hook refuses activations over a byte budget."""
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    budget_bytes = 64 * 4 * 37  # first layer's output holds 37 rows of 64 fp32

    def hook(module: nn.Module, args: object, out: torch.Tensor) -> None:
        if out.numel() * out.element_size() > budget_bytes:
            raise torch.OutOfMemoryError("simulated")

    model[0].register_forward_hook(hook)

    def try_step(batch: int) -> None:
        model(torch.randn(batch, 16)).sum().backward()
        model.zero_grad(set_to_none=True)

    released: list[int] = []
    result = find_batch_size(try_step, agree=identity, release=lambda: released.append(1))
    assert result.size == 37
    assert len(released) == sum(not p.fits for p in result.probes)


def test_other_rank_failure_counts_as_failure() -> None:
    """This rank fits 100, another only 40: the agreement makes the answer 40."""

    sizes: list[int] = []

    def try_step(batch: int) -> None:
        sizes.append(batch)
        if batch > 100:
            raise torch.OutOfMemoryError("local")

    def agree(fit_flag: int) -> int:
        other_fits = sizes[-1] <= 40
        return min(fit_flag, int(other_fits))

    result = find_batch_size(try_step, agree=agree, release=nothing)
    assert result.size == 40


def test_non_oom_error_reraised_untouched() -> None:
    error = ValueError("bad shape")

    def try_step(batch: int) -> None:
        if batch > 4:
            raise error

    with pytest.raises(ValueError) as info:
        find_batch_size(try_step, agree=identity, release=nothing)
    assert info.value is error


def test_runtime_call_out_of_memory_counts_as_does_not_fit() -> None:
    """A CUDA/HIP runtime call's allocation failure is "does not fit", like the caching
    allocator's torch.OutOfMemoryError."""
    error_type = getattr(torch, "AcceleratorError", RuntimeError)  # torch >= 2.9

    def try_step(batch: int) -> None:
        if batch > 5:
            raise error_type("HIP error: out of memory" if batch % 2 else
                             "CUDA error: out of memory")

    result = find_batch_size(try_step, start=4, agree=identity, release=nothing)
    assert result.size == 5


def test_nothing_fits() -> None:
    with pytest.raises(OutOfMemoryBackoffError, match="micro-batch 1"):
        find_batch_size(limited(5, 10), start=4, agree=identity, release=nothing)


def test_bad_bounds() -> None:
    with pytest.raises(ConfigError, match="start=10, max_size=5"):
        find_batch_size(limited(5, 1), start=10, max_size=5, agree=identity, release=nothing)


@pytest.mark.parametrize(
    ("effective", "micro", "expected"),
    [
        (None, 37, (37, 1)),
        (32, 100, (32, 1)),
        (256, 100, (64, 4)),
        (256, 37, (32, 8)),
        (100, 37, (25, 4)),
        (127, 64, (64, 2)),  # prime: rounded up to 128, never below the found size / 2
    ],
)
def test_keep_effective(effective: int | None, micro: int, expected: tuple[int, int]) -> None:
    got = keep_effective(effective, micro)
    assert got == expected
    assert got[0] <= micro
    if effective is not None:
        assert got[0] * got[1] >= effective


def test_keep_effective_exact_on_request() -> None:
    assert keep_effective(127, 64, require_exact=True) == (1, 127)
