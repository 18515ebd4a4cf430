"""Balancing layers over pipeline stages.

``balance`` is a list of layer counts, one per stage: ``[3, 5]`` puts the first 3
layers on stage 0 and the next 5 on stage 1.

- :func:`solve_partition` — the pure solver: a contiguous partition of per-layer costs
  into ``k`` non-empty blocks minimising the largest block (exact, dynamic programming).
- :func:`balance_by_size` — cost = parameter bytes (times ``param_scale`` for grads and
  optimizer state) + activation bytes saved for backward, measured with a sample.
- :func:`balance_by_time` — cost = median forward+backward seconds of each layer on the
  target device with a sample batch.
- :func:`validate_balance` — BalanceError with the numbers and a suggested balance.

Profiling runs on deep copies of the layers, one at a time, so the model's weights,
gradients and BatchNorm statistics are untouched.
"""

from __future__ import annotations

import copy
import math
import operator
import statistics
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import SupportsIndex, TypeVar

import torch
from torch import nn
from torch.autograd.graph import Node

from torchgpu.errors import BalanceError
from torchgpu.parallel.microbatch import map_tensors, tensors_in

T = TypeVar("T")


def even_balance(n_layers: int, parts: int) -> list[int]:
    """Layer counts as equal as possible, larger stages first.

    ``even_balance(8, 3) == [3, 3, 2]``
    """
    if parts < 1 or n_layers < parts:
        raise BalanceError(
            f"cannot split {n_layers} layers into {parts} stages: every stage needs at least one "
            f"layer, so use between 1 and {max(n_layers, 1)} devices"
        )
    q, r = divmod(n_layers, parts)
    return [q + 1 if i < r else q for i in range(parts)]


def solve_partition(costs: Sequence[float], parts: int) -> list[int]:
    """Split ``costs`` into ``parts`` contiguous non-empty blocks minimising the largest
    block sum; returns the block lengths (a balance). Exact, O(parts * n^2).

    Among optimal answers the one with the smallest blocks first is returned.
    """
    n = len(costs)
    if parts < 1 or n < parts:
        raise BalanceError(
            f"cannot split {n} layers into {parts} stages: every stage needs at least one layer, "
            f"so use between 1 and {max(n, 1)} stages"
        )
    if any(c < 0 or math.isnan(c) for c in costs):
        raise BalanceError(f"layer costs must be non-negative numbers, got {list(costs)}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = math.inf
    # best[j][i]: smallest possible largest block for the first i layers in j blocks.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for j in range(1, parts + 1):
        for i in range(j, n - (parts - j) + 1):
            for p in range(j - 1, i):
                value = max(best[j - 1][p], prefix[i] - prefix[p])
                # '<=' keeps the latest cut among ties: later blocks as large as allowed.
                if value <= best[j][i]:
                    best[j][i] = value
                    cut[j][i] = p
    sizes: list[int] = []
    i = n
    for j in range(parts, 0, -1):
        p = cut[j][i]
        sizes.append(i - p)
        i = p
    return sizes[::-1]


def block_costs(costs: Sequence[float], balance: Sequence[int]) -> list[float]:
    """The summed cost of each stage of ``balance``."""
    out, start = [], 0
    for size in balance:
        out.append(float(sum(costs[start : start + size])))
        start += size
    return out


def validate_balance(
    balance: Sequence[int],
    n_layers: int,
    n_devices: int | None = None,
    costs: Sequence[float] | None = None,
) -> list[int]:
    """Return ``balance`` as a list if it partitions ``n_layers`` layers over
    ``n_devices`` stages; otherwise raise BalanceError naming the numbers and a fix
    (a suggested balance: cost-balanced if ``costs`` are given, else even)."""
    values = [_as_count(b) for b in balance]
    parts = n_devices if n_devices is not None else len(values)

    def suggestion() -> str:
        if parts < 1 or n_layers < parts:
            return f"use at most {n_layers} devices (one layer per stage at least)"
        best = solve_partition(costs, parts) if costs is not None else even_balance(n_layers, parts)
        return f"try balance={best}"

    if parts > n_layers:
        raise BalanceError(
            f"{parts} stages requested but the model has only {n_layers} layers: every stage needs "
            f"at least one layer; use at most {n_layers} devices or split the model into more "
            "layers"
        )
    counts = [b for b in values if isinstance(b, int) and not isinstance(b, bool)]
    if len(counts) != len(values):
        raise BalanceError(
            f"balance {values} must be a list of integers (layers per stage); {suggestion()}"
        )
    if len(counts) != parts:
        raise BalanceError(
            f"balance {counts} has {len(counts)} stages but {parts} devices were given: give one "
            f"layer count per device; {suggestion()}"
        )
    if any(b <= 0 for b in counts):
        raise BalanceError(
            f"balance {counts} has an empty stage: every stage needs at least one layer; "
            f"{suggestion()}"
        )
    if sum(counts) != n_layers:
        raise BalanceError(
            f"balance {counts} covers {sum(counts)} layers but the model has {n_layers}: the "
            f"counts "
            f"must add up to {n_layers}; {suggestion()}"
        )
    return counts


def _as_count(value: object) -> object:
    """``value`` as a Python int when it is an integer of any kind (numpy and 0-d torch
    integers included); anything else (a float, a bool, a string) unchanged, for the
    caller to refuse."""
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value


# --------------------------------------------------------------------------- profiling


def _tensors(obj: object) -> list[torch.Tensor]:
    return tensors_in(obj)


def _detach_to(obj: T, device: torch.device, grad: bool) -> T:
    """A fresh copy of ``obj``'s tensors on ``device``, cut from any graph. With
    ``grad``, floating tensors are non-leaf tensors requiring grad, as a stage's input
    is in a pipeline: an in-place first layer (``ReLU(inplace=True)``) works on them
    and never writes into the caller's sample."""

    def fresh(t: torch.Tensor) -> torch.Tensor:
        leaf = t.detach().to(device)
        if grad and leaf.is_floating_point():
            return leaf.requires_grad_(True).clone()
        return leaf.clone()

    return map_tensors(fresh, obj)


def _sample_device(sample: object) -> torch.device:
    tensors = _tensors(sample)
    return tensors[0].device if tensors else torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _backward(out: object) -> None:
    outs = [t for t in _tensors(out) if t.requires_grad]
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])


def _grad_leaves(out: object) -> list[torch.Tensor]:
    """The leaf tensors requiring grad that ``out``'s autograd graph reaches: the
    tensors a backward from ``out`` would accumulate a gradient into."""
    leaves = [t for t in _tensors(out) if t.requires_grad and t.grad_fn is None]
    stack: list[Node | None] = [t.grad_fn for t in _tensors(out) if t.grad_fn is not None]
    visited: list[Node] = []  # kept alive so that ids stay unique during the walk
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        visited.append(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad holds its leaf
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        stack.extend(nxt for nxt, _ in node.next_functions)
    return leaves


def saved_bytes(layer: nn.Module, x: object) -> tuple[int, object]:
    """Bytes ``layer(x)`` saves for backward (unique storages, parameters excluded)
    and the output."""
    saved, _created, y = _profile_bytes(layer, x)
    return saved, y


def _profile_bytes(layer: nn.Module, x: object) -> tuple[int, int, object]:
    """``(saved, created, output)`` of ``layer(x)``: bytes saved for backward, and bytes
    of the tensors requiring grad that the layer made itself (a weight built in
    forward): like a parameter such a tensor lives until backward and gets a gradient
    of its size. Unique storages; the layer's parameters and the input excluded."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    inputs = [*_tensors(x), *_grad_leaves(x)]  # the input and the leaves it was made from
    input_ptrs = {t.untyped_storage().data_ptr() for t in inputs}
    seen: dict[tuple[str, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_ptrs:
            seen[(str(t.device), storage.data_ptr())] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    created: dict[tuple[str, int], int] = {}
    for leaf in _grad_leaves(y):
        storage = leaf.untyped_storage()
        if storage.data_ptr() not in param_ptrs | input_ptrs:
            created[(str(leaf.device), storage.data_ptr())] = storage.nbytes()
    saved = sum(n for key, n in seen.items() if key not in created)
    return saved, sum(created.values()), y


@contextmanager
def _profiling(device: torch.device) -> Iterator[None]:
    """Around profiling: gradients on, and the random number generators (CPU and
    ``device``) put back afterwards, so a Dropout in a profiled copy does not change
    the draws of the training that follows."""
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), torch.enable_grad():
        yield


def _probe(layer: nn.Module, device: torch.device) -> nn.Module:
    """A copy of ``layer`` on ``device`` in training mode: profiling measures what a
    training step costs (Dropout masks, BatchNorm batch statistics) whatever mode the
    model is in now, and the model itself (mode, weights, statistics) is not touched."""
    probe = copy.deepcopy(layer)
    probe.to(device)  # in place; a layer's own .to() override may return nothing
    probe.train(True)
    return probe


def layer_sizes(
    layers: Iterable[nn.Module], sample: object | None = None, param_scale: float = 2.0
) -> list[int]:
    """Bytes per layer: ``param_scale`` x parameter bytes, plus (with ``sample``) the
    bytes the layer saves for backward on that sample (unique storages, parameters
    excluded) and twice the bytes of tensors requiring grad that the layer creates in
    forward (value and gradient, like a parameter). ``param_scale=2`` counts weights
    and gradients; use 4 for Adam. A parameter shared by several layers (a reused
    module, tied weights) counts at its first layer only. The sample's batch size should
    be the micro-batch size the pipeline will run. Runs training-mode copies of the
    layers; the layers, their mode and the random number generators are left as they were."""
    out: list[int] = []
    x = sample
    device = _sample_device(sample)
    counted: set[int] = set()
    with _profiling(device):
        for layer in layers:
            params = [p for p in layer.parameters() if id(p) not in counted]
            counted.update(id(p) for p in params)
            param_bytes = sum(p.numel() * p.element_size() for p in params)
            act_bytes = 0
            if sample is not None:
                probe = _probe(layer, device)
                saved, created, y = _profile_bytes(probe, _detach_to(x, device, grad=True))
                act_bytes = saved + 2 * created
                x = _detach_to(y, device, grad=False)
                del probe, y
            out.append(int(param_scale * param_bytes) + act_bytes)
    return out


def balance_by_size(
    layers: Sequence[nn.Module],
    partitions: int,
    sample: object | None = None,
    param_scale: float = 2.0,
) -> list[int]:
    """Balance so each stage holds about the same bytes (see :func:`layer_sizes`)."""
    layers = list(layers)
    return solve_partition([float(s) for s in layer_sizes(layers, sample, param_scale)], partitions)


def layer_times(
    layers: Iterable[nn.Module],
    sample: object,
    device: torch.device | str | None = None,
    runs: int = 5,
    warmup: int = 1,
) -> list[float]:
    """Median forward+backward seconds of each layer on ``device`` (default: the
    sample's device) over ``runs`` timed runs after ``warmup`` untimed ones. CUDA is
    synchronised around each run so the time covers the kernels, not the launch.
    Times training-mode copies of the layers (a training step is what the balance is
    for); the layers, their mode and the random number generators are left as they were."""
    dev = torch.device(device) if device is not None else _sample_device(sample)
    x = _detach_to(sample, dev, grad=False)
    out: list[float] = []
    with _profiling(dev):
        for layer in layers:
            probe = _probe(layer, dev)
            samples: list[float] = []
            y: object = None
            for r in range(warmup + runs):
                inp = _detach_to(x, dev, grad=True)
                _sync(dev)
                start = time.perf_counter()
                y = probe(inp)
                _backward(y)
                _sync(dev)
                if r >= warmup:
                    samples.append(time.perf_counter() - start)
            out.append(statistics.median(samples))
            x = _detach_to(y, dev, grad=False)
            del probe
    return out


def balance_by_time(
    layers: Sequence[nn.Module],
    partitions: int,
    sample: object,
    device: torch.device | str | None = None,
    runs: int = 5,
    warmup: int = 1,
) -> list[int]:
    """Balance so each stage takes about the same forward+backward time on ``device``
    (see :func:`layer_times`)."""
    layers = list(layers)
    return solve_partition(layer_times(layers, sample, device, runs, warmup), partitions)
