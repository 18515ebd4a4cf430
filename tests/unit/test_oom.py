"""OOM back-off: exact halving sequences, effective batch kept, errors never swallowed."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from torchgpu.errors import ConfigError, OutOfMemoryBackoffError
from torchgpu.memory.oom import (
    BatchSplit,
    OOMBackoff,
    is_oom,
    release_failed_step,
    split_batch,
)


def identity(value: int) -> int:
    return value


class OOMAbove(nn.Module):
    """A small MLP whose forward hook raises torch.OutOfMemoryError for big batches."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.limit = limit
        self.seen: list[int] = []
        self.net[0].register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, args: object, output: torch.Tensor) -> None:
        self.seen.append(output.shape[0])
        if output.shape[0] > self.limit:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {output.shape[0]} MiB.\nmore text"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


def train_window(
    model: OOMAbove, opt: torch.optim.Optimizer, data: torch.Tensor, micro: int, accumulate: int
) -> None:
    """One optimizer step over ``micro * accumulate`` rows, in ``accumulate`` micro-steps."""
    for i in range(accumulate):
        chunk = data[i * micro : (i + 1) * micro]
        loss = model(chunk).pow(2).mean() / accumulate
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def run_with_backoff(
    model: OOMAbove, backoff: OOMBackoff, data: torch.Tensor
) -> list[tuple[int, int]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sequence = [(backoff.micro_batch, backoff.accumulate)]
    while True:
        error: BaseException | None = None
        try:
            train_window(model, opt, data, backoff.micro_batch, backoff.accumulate)
        except Exception as caught:
            error = caught
        decision = backoff.check(error)
        if decision is None:
            return sequence
        release_failed_step(model, opt, error)
        sequence.append((decision.micro_batch, decision.accumulate))


def test_backoff_sequence_from_forward_hook_keeps_effective_batch() -> None:
    model = OOMAbove(limit=16)
    backoff = OOMBackoff(64, 1, agree=identity)
    sequence = run_with_backoff(model, backoff, torch.randn(64, 4))
    assert sequence == [(64, 1), (32, 2), (16, 4)]
    assert [d.effective_batch for d in backoff.history] == [64, 64]
    assert all(d.exact for d in backoff.history)
    assert backoff.effective_batch == 64
    # the successful window ran 4 micro-steps of 16 after the two failed forwards
    assert model.seen == [64, 32, 16, 16, 16, 16]
    assert backoff.history[0].reason == "CUDA out of memory. Tried to allocate 64 MiB."
    assert "now micro-batch 32 x2" in backoff.history[0].describe()


def test_backoff_with_existing_accumulation() -> None:
    backoff = OOMBackoff(24, 2, agree=identity)
    sequence = run_with_backoff(OOMAbove(limit=5), backoff, torch.randn(48, 4))
    assert sequence == [(24, 2), (12, 4), (6, 8), (3, 16)]
    assert backoff.effective_batch == 48


def test_odd_micro_batch_exact_when_a_near_divisor_exists() -> None:
    backoff = OOMBackoff(5, 2, agree=identity)  # E = 10, cap ceil(5/2) = 3 -> divisor 2
    decision = backoff.on_oom(torch.OutOfMemoryError("oom"))
    assert (decision.micro_batch, decision.accumulate, decision.exact) == (2, 5, True)
    backoff = OOMBackoff(7, 2, agree=identity)  # E = 14, cap 4 -> divisor 2 (2*2 >= 4)
    decision = backoff.on_oom(torch.OutOfMemoryError("oom"))
    assert (decision.micro_batch, decision.accumulate, decision.exact) == (2, 7, True)


def test_prime_effective_batch_rounds_up_and_says_so() -> None:
    backoff = OOMBackoff(127, 1, agree=identity)
    decision = backoff.on_oom(torch.OutOfMemoryError("oom"))
    assert (decision.micro_batch, decision.accumulate) == (64, 2)
    assert decision.effective_batch == 128 and not decision.exact
    exact = OOMBackoff(127, 1, agree=identity, require_exact=True)
    decision = exact.on_oom(torch.OutOfMemoryError("oom"))
    assert (decision.micro_batch, decision.accumulate, decision.exact) == (1, 127, True)


@pytest.mark.parametrize(
    ("effective", "cap", "expected"),
    [
        (64, 32, BatchSplit(32, 2, True)),
        (64, 100, BatchSplit(64, 1, True)),
        (12, 5, BatchSplit(4, 3, True)),
        (127, 64, BatchSplit(64, 2, False)),
        (5, 3, BatchSplit(3, 2, False)),
        (1, 1, BatchSplit(1, 1, True)),
        (96, 7, BatchSplit(6, 16, True)),
    ],
)
def test_split_batch_table(effective: int, cap: int, expected: BatchSplit) -> None:
    got = split_batch(effective, cap)
    assert got == expected
    assert got.micro_batch <= cap
    assert got.effective_batch >= effective
    assert got.effective_batch - effective < got.accumulate


def test_split_batch_respects_floor() -> None:
    got = split_batch(10, 4, min_micro_batch=3)
    assert got.micro_batch >= 3 and got.micro_batch <= 4
    with pytest.raises(ConfigError, match="effective batch of 0"):
        split_batch(0, 4)


def test_min_micro_batch_floor_raises_with_numbers() -> None:
    backoff = OOMBackoff(8, 1, min_micro_batch=4, device="cpu", agree=identity)
    backoff.on_oom(torch.OutOfMemoryError("first"))
    assert backoff.micro_batch == 4
    with pytest.raises(OutOfMemoryBackoffError) as info:
        backoff.on_oom(torch.OutOfMemoryError("second"))
    assert "micro-batch 4 on cpu" in str(info.value)
    assert "8 -> 4" in str(info.value)


def test_micro_batch_one_gives_clear_error_with_numbers_and_fix() -> None:
    model = OOMAbove(limit=0)  # nothing fits
    backoff = OOMBackoff(4, 2, device="cpu", agree=identity)
    with pytest.raises(OutOfMemoryBackoffError) as info:
        run_with_backoff(model, backoff, torch.randn(8, 4))
    message = str(info.value)
    assert "micro-batch 1 on cpu" in message
    assert "effective batch 8" in message
    assert "4 -> 2 -> 1" in message
    assert "Tried to allocate 1 MiB" in message
    assert "activation checkpointing" in message and "torchgpu plan" in message
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    assert "\n" not in message


def test_non_oom_errors_are_reraised_untouched() -> None:
    backoff = OOMBackoff(8, 1, agree=identity)
    error = ValueError("shapes do not match")
    with pytest.raises(ValueError) as info:
        backoff.check(error)
    assert info.value is error
    runtime = RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    with pytest.raises(RuntimeError) as info2:
        backoff.on_oom(runtime)
    assert info2.value is runtime
    assert backoff.history == [] and backoff.micro_batch == 8


def test_is_oom_recognises_allocator_errors() -> None:
    assert is_oom(torch.OutOfMemoryError("x"))
    assert is_oom(torch.cuda.OutOfMemoryError("x"))
    try:
        torch.empty(2**62, dtype=torch.uint8)
    except RuntimeError as real_cpu_oom:
        assert is_oom(real_cpu_oom)
    else:  # pragma: no cover - an allocator that hands out 4 EiB
        pytest.fail("allocating 4 EiB succeeded")
    assert is_oom(RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"))
    assert not is_oom(RuntimeError("expected scalar type Float"))
    assert not is_oom(MemoryError())
    assert not is_oom(OutOfMemoryBackoffError("ours"))
    assert not is_oom(None)


# What torch and the device libraries print: every allocation failure, and device errors
# that mention memory or look alike but that a smaller micro-batch does not cure.
_ACCELERATOR_ERROR = getattr(torch, "AcceleratorError", RuntimeError)  # torch >= 2.9


@pytest.mark.parametrize(
    ("error", "oom"),
    [
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 7.79 GiB "
                      "total capacity)"), True),
        (_ACCELERATOR_ERROR("CUDA error: out of memory\nCUDA kernel errors might be "
                            "asynchronously reported at some other API call"), True),
        (RuntimeError("CUDA error: out of memory"), True),
        (RuntimeError("CUDA driver error: out of memory"), True),
        (RuntimeError("HIP out of memory. Tried to allocate 1.00 GiB"), True),
        (_ACCELERATOR_ERROR("HIP error: out of memory"), True),
        (RuntimeError("HIP error: hipErrorOutOfMemory"), True),
        (RuntimeError("XPU out of memory. Tried to allocate 512.00 MiB"), True),
        (RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"), True),
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling "
                      "`cublasCreate(handle)`"), True),
        (RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), True),
        (RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: "
                      "can't allocate memory: you tried to allocate 4611686018427387904 "
                      "bytes."), True),
        (RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if "
                      "you passed in a non-contiguous input."), False),
        (_ACCELERATOR_ERROR("CUDA error: an illegal memory access was encountered"), False),
        (_ACCELERATOR_ERROR("CUDA error: device-side assert triggered"), False),
        (RuntimeError("index 7 is out of bounds for dimension 0 with size 4"), False),
        (RuntimeError("CUDA error: misaligned address"), False),
        (RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm`"),
         False),
        (RuntimeError("Expected all tensors to be on the same device"), False),
        (RuntimeError("expected scalar type Float"), False),
        (ValueError("CUDA out of memory"), False),  # not from an allocator
        (MemoryError(), False),
        (OutOfMemoryBackoffError("out of memory at micro-batch 1"), False),
    ],
    ids=lambda value: first_words(value),
)
def test_is_oom_table(error: BaseException, oom: bool) -> None:
    assert is_oom(error) is oom


def first_words(value: object) -> str:
    if isinstance(value, BaseException):
        return f"{type(value).__name__}:{' '.join(str(value).split()[:4])}"
    return str(value)


def test_backoff_steps_down_on_a_runtime_call_out_of_memory() -> None:
    """The error a failed cudaMalloc outside the caching allocator raises (a cuBLAS
    handle, a kernel's scratch) backs off like the caching allocator's own."""
    backoff = OOMBackoff(8, 1, agree=identity)
    decision = backoff.check(_ACCELERATOR_ERROR("CUDA error: out of memory"))
    assert decision is not None and (decision.micro_batch, decision.accumulate) == (4, 2)


def test_ranks_agree_when_only_one_ran_out() -> None:
    """A rank with no error still backs off when another rank's agreement says so."""
    reported: list[int] = []

    def other_rank_failed(value: int) -> int:
        reported.append(value)
        return 0 if len(reported) == 1 else value  # first call: "some rank OOMed"

    backoff = OOMBackoff(32, 1, agree=other_rank_failed)
    decision = backoff.check(None)
    assert decision is not None
    assert (decision.micro_batch, decision.accumulate) == (16, 2)
    assert decision.reason == "another rank ran out of memory"
    assert reported == [1, 16]
    fine = OOMBackoff(32, 1, agree=identity)
    assert fine.check(None) is None and fine.micro_batch == 32


def test_agreed_minimum_micro_batch_wins() -> None:
    # another rank proposes 4: this rank follows, recomputing accumulation for E = 32
    backoff = OOMBackoff(32, 1, agree=lambda v: min(v, 4) if v > 1 else 0)
    decision = backoff.on_oom(torch.OutOfMemoryError("oom"))
    assert (decision.micro_batch, decision.accumulate) == (4, 8)


def test_default_agree_is_identity_without_process_group() -> None:
    backoff = OOMBackoff(10, 1)
    assert backoff.check(None) is None
    decision = backoff.on_oom(torch.OutOfMemoryError("oom"))
    assert (decision.micro_batch, decision.accumulate) == (5, 2)


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="micro_batch=0"):
        OOMBackoff(0, 1)


def test_release_failed_step_frees_activations_and_grads() -> None:
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    assert model.weight.grad is not None
    holder: list[weakref.ref[torch.Tensor]] = []

    def failing_step() -> None:
        activation = torch.randn(64, 64)
        holder.append(weakref.ref(activation))
        raise torch.OutOfMemoryError("oom")

    try:
        failing_step()
    except torch.OutOfMemoryError as error:
        kept = error
    assert holder[0]() is not None  # the traceback keeps the failed step's tensors alive
    release_failed_step(model, opt, kept)
    gc.collect()
    assert holder[0]() is None
    assert model.weight.grad is None
    assert not torch.cuda.is_initialized()
