"""Activation memory measured on fake tensors: what autograd saves for backward.

One forward pass runs under ``FakeTensorMode`` with fake CPU copies of the model's
parameters and of the sample batch (``torch.func.functional_call``, so the model itself
is untouched and nothing is allocated at its real size). A
``torch.autograd.graph.saved_tensors_hooks`` pack hook records each saved tensor's
storage; every storage counts once, with its full size, as
:func:`torchgpu.memory.saved_tensors.saved_tensor_bytes` counts real tensors.
Parameters (leaves that require grad) are not activations and are not counted;
autocast's low-precision copies of them are.

The sample batch may have any structure, as the training engine takes it: a tensor
(``model(x)``), a tuple or list (``model(*inputs)``), a dict (``model(**batch)``),
nested containers of those; integer tensors (token ids) keep their dtype. A model that
computes its own loss (``output.loss``) has it measured with the forward.

Mixed precision runs the forward under CPU autocast, whose casting rules match CUDA's
for the layers that hold most activations (convolutions and linear layers run in the
low-precision dtype) but not op for op.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
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
from torchgpu.fake_checks import IndexDtypeCheck

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
    layer ``i`` saved / took as input; without one, they are empty. Without a view,
    ``block_names``/``block_saved``/``block_inputs`` are the same for the model's
    repeated blocks (:func:`torchgpu.memory.repeated_blocks.find_repeated_blocks`), which activation
    checkpointing recomputes; empty when it has none.
    """

    batch_size: int
    precision: str
    sizes: Mapping[int, int]
    saved: frozenset[int]
    layer_names: tuple[str, ...]
    layer_saved: tuple[frozenset[int], ...]
    layer_inputs: tuple[frozenset[int], ...]
    block_names: tuple[str, ...] = field(default=())
    block_saved: tuple[frozenset[int], ...] = field(default=())
    block_inputs: tuple[frozenset[int], ...] = field(default=())

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


def sequential_layers(model: nn.Module, sample_batch: Any = None) -> nn.Sequential | None:
    """The model as an ``nn.Sequential``: itself, ``as_sequential()``, or a list of
    blocks (an ``nn.ModuleList`` run in order, as the model/pipeline strategies run it);
    None for any other model.

    With ``sample_batch`` given, None too when the view cannot take that batch: a
    Sequential passes one input from layer to layer, so a dict (``model(**batch)``) or a
    tuple of inputs (``model(*inputs)``) goes through the model's own forward, and its
    memory is measured there."""
    if sample_batch is not None and not takes_one_input(sample_batch):
        return None
    if isinstance(model, nn.Sequential):
        return model
    if isinstance(model, nn.ModuleList):
        return nn.Sequential(*model)
    view = getattr(model, "as_sequential", None)
    if callable(view):
        seq = view()
        if isinstance(seq, nn.Sequential):
            return seq
    return None


@dataclass(frozen=True)
class SampleCall:
    """How the model is called on a sample batch: ``model(*args, **kwargs)``."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    batch_size: int


def tensor_leaves(obj: Any) -> list[torch.Tensor]:
    """The tensors in ``obj`` (dicts, tuples, lists, nested), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in tensor_leaves(v)]
    if isinstance(obj, tuple | list):
        return [t for v in obj for t in tensor_leaves(v)]
    return []


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` (tensors in dicts, tuples, namedtuples, lists) with ``fn`` applied to
    every tensor; other leaves are kept."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if isinstance(obj, tuple | list):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


def as_call(sample_batch: Any) -> SampleCall:
    """The model call for ``sample_batch``, by the engine's convention: a tensor (or a
    namedtuple) is one input, a tuple/list is ``model(*inputs)``, a dict (any Mapping)
    is ``model(**batch)``; containers may nest. The batch size is the first dimension
    of the first tensor that has one. Raises :class:`ConfigError` without such a tensor.
    """
    if isinstance(sample_batch, Mapping):
        call = SampleCall((), dict(sample_batch), 0)
    elif isinstance(sample_batch, tuple | list) and not hasattr(sample_batch, "_fields"):
        call = SampleCall(tuple(sample_batch), {}, 0)
    else:
        call = SampleCall((sample_batch,), {}, 0)
    tensors = tensor_leaves([call.args, call.kwargs])
    batched = [t for t in tensors if t.dim() > 0]
    if not batched:
        found = "only scalar tensors" if tensors else f"a {type(sample_batch).__name__}"
        raise ConfigError(
            f"sample_batch must be a tensor, a tuple/list or a dict of tensors with a batch "
            f"dimension (the model's inputs, batch first), got {found}; e.g. "
            "torch.empty(32, 3, 224, 224, device='meta') or {'input_ids': torch.zeros(8, "
            "128, dtype=torch.long)} cost no memory"
        )
    return SampleCall(call.args, call.kwargs, int(batched[0].shape[0]))


def takes_one_input(sample_batch: Any) -> bool:
    """Whether ``sample_batch`` is one input (``model(x)``), the only call a sequential
    view can take; a dict or a tuple/list of inputs is not."""
    call = as_call(sample_batch)
    return len(call.args) == 1 and not call.kwargs


def _storage_key(t: torch.Tensor, sizes: dict[int, int], alive: list[Any]) -> int:
    storage = t.untyped_storage()
    key = int(storage._cdata)
    sizes[key] = int(storage.nbytes())
    alive.append(storage)  # keep it alive: a freed storage's address may be reused
    return key


def _fake_like(t: torch.Tensor) -> torch.Tensor:
    # Same shape, strides and dtype (token ids stay integers); inputs that are floats
    # and require grad keep requiring it.
    fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
    return fake.requires_grad_(t.requires_grad and t.is_floating_point())


def measure_activations(
    model: nn.Module,
    sample_batch: Any,
    precision: str = "fp32",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> ActivationProfile:
    """Measure what one training forward of ``model`` on ``sample_batch`` saves.

    ``sample_batch``: the model's inputs, of any structure (see :func:`as_call`); it
    may hold real, meta or fake tensors: only shapes and dtypes are used.
    ``loss_fn(output)``, when given, runs in the measured region too (a loss the model
    computes itself, ``output.loss``, is part of the forward anyway).
    Raises :class:`ConfigError` for a bad precision or sample, or a forward whose
    control flow reads tensor values (it cannot run on fake tensors).
    """
    from torchgpu.memory.repeated_blocks import find_repeated_blocks
    from torchgpu.parallel.data import unwrap

    if precision not in PRECISIONS:
        raise ConfigError(
            f"precision={precision!r} is not allowed: use one of {', '.join(PRECISIONS)}"
        )
    call = as_call(sample_batch)
    view = sequential_layers(model, sample_batch)
    runner: nn.Module = view if view is not None else model
    layers = list(view.children()) if view is not None else []
    found = find_repeated_blocks(model) if view is None else None
    block_names = found.names if found is not None else ()
    named = dict(unwrap(model).named_modules())
    blocks = [named[name] for name in block_names]
    sizes: dict[int, int] = {}
    alive: list[Any] = []
    saved: set[int] = set()
    # one slot per layer of the view, or per repeated block
    slot_saved: list[set[int]] = [set() for _ in (layers or blocks)]
    slot_inputs: list[set[int]] = [set() for _ in (layers or blocks)]
    current = [-1]

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if base.is_leaf and base.requires_grad:
            return t
        key = _storage_key(t, sizes, alive)
        saved.add(key)
        if current[0] >= 0:
            slot_saved[current[0]].add(key)
        return t

    def enter(index: int) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
        def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            current[0] = index
            for a in tensor_leaves([args, kwargs]):
                slot_inputs[index].add(_storage_key(a, sizes, alive))

        return hook

    def leave(_module: nn.Module, _args: Any, _out: Any) -> None:
        current[0] = -1  # between blocks: saved tensors belong to no block

    handles = [
        layer.register_forward_pre_hook(enter(i), with_kwargs=True)
        for i, layer in enumerate(layers or blocks)
    ]
    handles += [block.register_forward_hook(leave) for block in blocks]
    dtype = PRECISIONS[precision]
    try:
        # IndexDtypeCheck: float token ids fail here as on real tensors, in every torch
        # (2.11's meta kernel for embedding accepts them).
        with FakeTensorMode(), IndexDtypeCheck():
            fakes: dict[int, torch.Tensor] = {}
            state: dict[str, torch.Tensor] = {}
            tensors = [
                *runner.named_parameters(remove_duplicate=False),
                *runner.named_buffers(remove_duplicate=False),
            ]
            for name, t in tensors:
                if id(t) not in fakes:  # tied weights stay tied
                    fakes[id(t)] = _fake_like(t).requires_grad_(t.requires_grad)
                state[name] = fakes[id(t)]
            args = map_tensors(call.args, _fake_like)
            kwargs = map_tensors(call.kwargs, _fake_like)
            autocast = torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=bool(dtype))
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
                out = functional_call(runner, state, args, kwargs)
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
    slots = (tuple(frozenset(x) for x in slot_saved), tuple(frozenset(x) for x in slot_inputs))
    return ActivationProfile(
        batch_size=call.batch_size,
        precision=precision,
        sizes=sizes,
        saved=frozenset(saved),
        layer_names=tuple(type(layer).__name__ for layer in layers),
        layer_saved=slots[0] if layers else (),
        layer_inputs=slots[1] if layers else (),
        block_names=tuple(block_names),
        block_saved=slots[0] if blocks else (),
        block_inputs=slots[1] if blocks else (),
    )
