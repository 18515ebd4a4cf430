"""Activation memory measured on fake tensors: what autograd saves for backward.

One forward pass runs under ``FakeTensorMode`` with fake CPU copies of the model's
parameters and of the sample batch (``torch.func.functional_call``, so the model itself
is untouched and nothing is allocated at its real size). A
``torch.autograd.graph.saved_tensors_hooks`` pack hook records each saved tensor's
storage; every storage counts once, with its full size, as
:func:`torchgpu.memory.saved_tensor_bytes` counts real tensors. Parameters (leaves that
require grad) are not activations and are not counted; autocast's low-precision copies
of them are.

Mixed precision runs the forward under CPU autocast, whose casting rules match CUDA's
for the layers that hold most activations (convolutions and linear layers run in the
low-precision dtype) but not op for op.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)
from torch.func import functional_call

from torchgpu.errors import ConfigError

PRECISIONS: dict[str, torch.dtype | None] = {
    "fp32": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


@dataclass(frozen=True, eq=False)
class ActivationProfile:
    """Saved-for-backward storages of one forward pass at ``batch_size`` samples.

    ``sizes`` maps a storage key to its bytes (saved storages and layer inputs).
    ``saved`` are the keys autograd saved. With a sequential view (``nn.Sequential``
    or ``as_sequential()``), ``layer_saved[i]``/``layer_inputs[i]`` are the storages
    layer ``i`` saved / took as input; without one, they are empty.
    """

    batch_size: int
    precision: str
    sizes: Mapping[int, int]
    saved: frozenset[int]
    layer_names: tuple[str, ...]
    layer_saved: tuple[frozenset[int], ...]
    layer_inputs: tuple[frozenset[int], ...]

    @property
    def saved_bytes(self) -> int:
        """Bytes saved for backward by the whole forward (each storage once)."""
        return sum(self.sizes[k] for k in self.saved)

    @property
    def largest_bytes(self) -> int:
        """The largest single saved storage (a proxy for backward's largest temporary)."""
        return max((self.sizes[k] for k in self.saved), default=0)

    def rounded(self, block_bytes: int) -> dict[int, int]:
        """``sizes`` with each storage rounded up to the allocator's ``block_bytes``."""
        return {k: -(-v // block_bytes) * block_bytes for k, v in self.sizes.items()}


def sequential_layers(model: nn.Module) -> nn.Sequential | None:
    """The model as an ``nn.Sequential`` (itself, or ``as_sequential()``), or None."""
    if isinstance(model, nn.Sequential):
        return model
    view = getattr(model, "as_sequential", None)
    if callable(view):
        seq = view()
        if isinstance(seq, nn.Sequential):
            return seq
    return None


def as_inputs(sample_batch: Any) -> tuple[torch.Tensor, ...]:
    """The model's positional inputs: a tensor, or a tuple/list of tensors."""
    items = tuple(sample_batch) if isinstance(sample_batch, tuple | list) else (sample_batch,)
    if not items or not all(isinstance(t, torch.Tensor) for t in items):
        raise ConfigError(
            f"sample_batch must be a tensor or a tuple of tensors (the model's inputs, "
            f"batch first), got {type(sample_batch).__name__}; e.g. torch.empty(32, 3, 224, "
            "224, device='meta') costs no memory"
        )
    if items[0].dim() == 0:
        raise ConfigError("sample_batch's first tensor is a scalar: it needs a batch dimension")
    return items


def _storage_key(t: torch.Tensor, sizes: dict[int, int], alive: list[Any]) -> int:
    storage = t.untyped_storage()
    key = int(storage._cdata)
    sizes[key] = int(storage.nbytes())
    alive.append(storage)  # keep it alive: a freed storage's address may be reused
    return key


def measure_activations(
    model: nn.Module,
    sample_batch: Any,
    precision: str = "fp32",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> ActivationProfile:
    """Measure what one training forward of ``model`` on ``sample_batch`` saves.

    ``sample_batch`` may hold real, meta or fake tensors; only shapes and dtypes are
    used. ``loss_fn(output)``, when given, runs in the measured region too.
    Raises :class:`ConfigError` for a bad precision or sample, or a forward whose
    control flow reads tensor values (it cannot run on fake tensors).
    """
    if precision not in PRECISIONS:
        raise ConfigError(
            f"precision={precision!r} is not allowed: use one of {', '.join(PRECISIONS)}"
        )
    inputs = as_inputs(sample_batch)
    view = sequential_layers(model)
    runner: nn.Module = view if view is not None else model
    layers = list(view.children()) if view is not None else []
    sizes: dict[int, int] = {}
    alive: list[Any] = []
    saved: set[int] = set()
    layer_saved: list[set[int]] = [set() for _ in layers]
    layer_inputs: list[set[int]] = [set() for _ in layers]
    current = [-1]

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if base.is_leaf and base.requires_grad:
            return t
        key = _storage_key(t, sizes, alive)
        saved.add(key)
        if current[0] >= 0:
            layer_saved[current[0]].add(key)
        return t

    def pre_hook(index: int) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(_module: nn.Module, args: tuple[Any, ...]) -> None:
            current[0] = index
            for a in args:
                if isinstance(a, torch.Tensor):
                    layer_inputs[index].add(_storage_key(a, sizes, alive))

        return hook

    handles = [layer.register_forward_pre_hook(pre_hook(i)) for i, layer in enumerate(layers)]
    dtype = PRECISIONS[precision]
    try:
        with FakeTensorMode():
            fakes: dict[int, torch.Tensor] = {}
            state: dict[str, torch.Tensor] = {}
            named = [
                *runner.named_parameters(remove_duplicate=False),
                *runner.named_buffers(remove_duplicate=False),
            ]
            for name, t in named:
                if id(t) not in fakes:  # tied weights stay tied
                    fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
                    fakes[id(t)] = fake.requires_grad_(t.requires_grad)
                state[name] = fakes[id(t)]
            args = tuple(
                torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).requires_grad_(
                    t.requires_grad and t.is_floating_point()
                )
                for t in inputs
            )
            autocast = torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=bool(dtype))
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
                out = functional_call(runner, state, args)
                current[0] = -1
                if loss_fn is not None:
                    loss_fn(out)
    except (DataDependentOutputException, DynamicOutputShapeException) as error:
        raise ConfigError(
            f"{type(model).__name__}'s forward depends on tensor values ({error}), so its "
            "memory cannot be measured on fake tensors; estimate a variant without "
            "value-dependent control flow"
        ) from None
    finally:
        for handle in handles:
            handle.remove()
    alive.clear()
    return ActivationProfile(
        batch_size=int(inputs[0].shape[0]),
        precision=precision,
        sizes=sizes,
        saved=frozenset(saved),
        layer_names=tuple(type(layer).__name__ for layer in layers),
        layer_saved=tuple(frozenset(s) for s in layer_saved),
        layer_inputs=tuple(frozenset(s) for s in layer_inputs),
    )
