"""Model parallelism: a sequential model's layers placed over devices.

``split_model(module, devices, balance)`` is the seed's ModelParallelResNet50
generalised: the layers are cut into one stage per device, each stage is moved to
its device, and ``forward`` moves the activation to the next stage's device.

Accepted models: an ``nn.Sequential``; a list of modules (each one a layer, so a
list as long as ``devices`` with no balance is one stage per device); or any module
with ``as_sequential() -> nn.Sequential`` whose children share the model's modules
(the built-in ResNet-50 and HousingNet). Every position of the sequential view is a
layer, also a module object used at several positions (``nn.Sequential(lin1, act,
lin2, act)`` has four layers). Such a module, or weights tied between layers, must
stay on one device: a split that would place it on two is refused
(:func:`check_shared_state`).

The split model owns placement, so ``.to(device)``, ``.cuda()`` and ``.cpu()`` are
refused; ``.to(dtype)`` is allowed. Its output lives on ``model.output_device`` (the
last stage's device): move labels there before the loss,
``loss_fn(model(x), y.to(model.output_device))``.

``state_dict()`` / ``load_state_dict()`` use the original model's keys, so a
checkpoint of a split model loads into the plain model and back.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from torchgpu.devices.cuda_status import cuda_device_count
from torchgpu.errors import (
    BalanceError,
    ConfigError,
    DeviceSpecError,
    NoDeviceError,
    PlacementError,
)
from torchgpu.parallel.balance import (
    balance_by_size,
    balance_by_time,
    even_balance,
    validate_balance,
)
from torchgpu.parallel.microbatch import map_tensors

T = TypeVar("T")

DeviceLike = str | int | torch.device
BalanceSpec = Sequence[int] | Literal["size", "time"] | None


def named_layers(
    module: nn.Module | Sequence[nn.Module],
) -> tuple[nn.Module, list[tuple[str, nn.Module]]]:
    """``(owner, [(name, layer), ...])``: the module whose state_dict is canonical and its
    layers in order, with the sequential view's child names (``"0"``, ``"1"``... or
    ``"stem"``, ``"layer1"``...).

    Every position the sequential view runs is listed, also a layer object that sits
    at several positions (``nn.Sequential(lin1, act, lin2, act)`` has four layers):
    ``named_children()`` would yield such an object once and silently drop a layer.
    """
    view = getattr(module, "as_sequential", None)
    if isinstance(module, nn.Sequential) and not callable(view):
        _check_plain_forward(module)
        return module, _positions(module)
    if isinstance(module, (list, tuple)) and all(isinstance(m, nn.Module) for m in module):
        seq = nn.Sequential(*module)
        return seq, _positions(seq)
    if isinstance(module, nn.Module) and callable(view):
        seq = view()
        if not isinstance(seq, nn.Sequential):
            raise ConfigError(
                f"{type(module).__name__}.as_sequential() returned {type(seq).__name__}, not "
                "nn.Sequential: it must return an nn.Sequential whose children share the model's "
                "modules"
            )
        return module, _positions(seq)
    raise ConfigError(
        f"cannot split a {type(module).__name__}: give an nn.Sequential, a list of modules, or a "
        "module with an as_sequential() method returning nn.Sequential"
    )


def _check_plain_forward(seq: nn.Sequential) -> None:
    """Refuse an ``nn.Sequential`` subclass with its own ``forward``: splitting runs its
    children one after another, which silently drops whatever that forward adds (a
    residual sum, a reshape). torchgpu's activation checkpointing counts as plain (its
    forward runs the same layers in order)."""
    base: type[nn.Module] = getattr(seq, "_torchgpu_ckpt_base", type(seq))
    if base.forward is nn.Sequential.forward:
        return
    raise ConfigError(
        f"cannot split a {base.__name__}: it is an nn.Sequential subclass with its own "
        "forward(), and a split runs its layers one after another, which would silently "
        f"skip what that forward does. Give {base.__name__} an as_sequential() method "
        "returning an nn.Sequential of the layers its forward runs, in order (wrap a residual "
        "or any extra step in a module of its own), or pass a plain nn.Sequential"
    )


def _positions(seq: nn.Sequential) -> list[tuple[str, nn.Module]]:
    # ``_modules`` is what ``Sequential.forward`` iterates: one entry per position, repeats
    # kept (``named_children()`` de-duplicates); a slot set to None is skipped by both.
    return [(name, layer) for name, layer in seq._modules.items() if layer is not None]


def check_shared_state(
    names: Sequence[str],
    layers: Sequence[nn.Module],
    places: Sequence[object],
    what: str = "device",
) -> None:
    """Refuse a split that puts one tensor on two places.

    A layer object used at several positions, or layers that share a parameter or
    buffer (tied weights), run correctly split only while every position holding that
    tensor is on the same ``place`` (``places[i]`` is layer ``i``'s device, or its
    rank for a multi-process pipeline): a tensor lives on one device, so the other
    stage would use it on the wrong device (or, across processes, train a copy that
    drifts apart). Stateless repeats (an activation used twice) are always fine.
    Raises ConfigError naming both layers, the tensor and the fix.
    """
    first: dict[int, tuple[int, str]] = {}  # id(tensor) -> (first position, tensor name)
    for i, layer in enumerate(layers):
        tensors = [*layer.named_parameters(), *layer.named_buffers()]
        for tname, tensor in tensors:
            seen = first.setdefault(id(tensor), (i, tname))
            j, jname = seen
            if j == i or places[j] == places[i]:
                continue
            same = layers[j] is layer
            how = (
                f"the same {type(layer).__name__} object is used at layers {names[j]!r} and "
                f"{names[i]!r}"
                if same
                else f"layers {names[j]!r} ({type(layers[j]).__name__}) and {names[i]!r} "
                f"({type(layer).__name__}) share the tensor {jname!r} / {tname!r}"
            )
            raise ConfigError(
                f"{how}, but the split puts them on {what} {places[j]} and {what} {places[i]}: "
                "its parameters and buffers can live on one device only, so one stage would "
                "use them in the wrong place (or train a separate copy). Plain PyTorch allows "
                "reusing a module; to split it, give each position its own instance "
                "(copy.deepcopy(layer)) if the weights need not be tied, or choose a balance "
                f"that keeps these layers on one {what}"
            )
def parse_devices(devices: Sequence[DeviceLike]) -> list[torch.device]:
    """Devices as ``torch.device`` (``"cuda"`` means ``cuda:0``, an int ``N`` means
    ``cuda:N``); repeats allowed. Raises DeviceSpecError / NoDeviceError up front."""
    if isinstance(devices, (str, torch.device)) or not devices:
        raise DeviceSpecError(
            f"devices must be a non-empty list such as ['cuda:0', 'cuda:1'] or ['cpu', 'cpu'], "
            f"got {devices!r}"
        )
    out: list[torch.device] = []
    for spec in devices:
        try:
            dev = torch.device(f"cuda:{spec}" if isinstance(spec, int) else spec)
        except (RuntimeError, TypeError) as exc:
            raise DeviceSpecError(
                f"device {spec!r} is not a device: use 'cpu', 'cuda', 'cuda:N' or an integer GPU "
                "index"
            ) from exc
        if dev.type == "cuda":
            dev = torch.device("cuda", dev.index or 0)
            if not torch.cuda.is_available():
                raise NoDeviceError(
                    f"{dev} requested but CUDA is not available in this process: use cpu devices "
                    "(e.g. ['cpu', 'cpu']) or run on a machine with a GPU"
                )
            count = cuda_device_count()
            if dev.index is not None and dev.index >= count:
                raise DeviceSpecError(
                    f"{dev} requested but {count} GPU(s) are visible: use cuda:0..cuda:{count - 1} "
                    "(devices may repeat, e.g. ['cuda:0', 'cuda:0'])"
                )
        out.append(dev)
    return out


def resolve_balance(
    layers: Sequence[nn.Module],
    devices: Sequence[torch.device],
    balance: BalanceSpec,
    sample: object | None = None,
) -> list[int]:
    """The layer counts per stage for ``balance`` (None: even by layer count)."""
    n, k = len(layers), len(devices)
    if n == 0:
        raise BalanceError(
            "the model has no layers (an empty nn.Sequential), so there is nothing to place on "
            f"{k} device(s): give a model with at least one layer per device"
        )
    if k > n:
        validate_balance([1] * k, n, k)  # raises with the numbers
    if balance is None:
        return even_balance(n, k)
    # ``isinstance`` first: ``array == "size"`` on a numpy array of counts is elementwise.
    if isinstance(balance, str) and balance == "size":
        return balance_by_size(layers, k, sample)
    if isinstance(balance, str) and balance == "time":
        if sample is None:
            raise BalanceError(
                "balance='time' needs sample=<an input batch> to profile each layer: pass a sample "
                "or use balance='size' or an explicit list of layer counts"
            )
        return balance_by_time(layers, k, sample, device=devices[0])
    if isinstance(balance, str):
        raise BalanceError(
            f"balance {balance!r} is not known: use None (even), 'size', 'time' or a list of "
            "layer counts"
        )
    return validate_balance(list(balance), n, k)  # a list, tuple or numpy array of counts


def move(obj: T, device: torch.device) -> T:
    """Tensors (also inside tuples, named tuples, lists and dicts) moved to ``device``;
    other values unchanged. Copies to CUDA are non-blocking (stream-ordered); copies to
    the CPU block, so the data is there on return."""
    return map_tensors(lambda t: t.to(device, non_blocking=device.type == "cuda"), obj)


def _refuse_move(model: nn.Module, what: str) -> PlacementError:
    placed = ", ".join(f"stage {i} on {d}" for i, d in enumerate(getattr(model, "devices", ())))
    return PlacementError(
        f"{type(model).__name__} places its stages itself ({placed}); {what} would move them all "
        "to one device. Build a new split with split_model(module, devices=[...]) to change "
        "devices; .to(dtype) alone is allowed"
    )


class SplitModel(nn.Module):
    """Stages of a sequential model on their devices, run one after another.

    Attributes: ``devices`` (one per stage), ``balance`` (layers per stage),
    ``partitions`` (the stage ``nn.Sequential``s, a plain list), ``input_device`` and
    ``output_device``. Like the sequential model, ``len(model)``, ``list(model)`` and
    ``model[i]`` give its layers by position. The original model is the registered
    child ``module``, so ``parameters()``, ``train()``, ``state_dict()`` see exactly its
    modules.
    """

    def __init__(
        self,
        owner: nn.Module,
        layers: Sequence[nn.Module],
        devices: Sequence[torch.device],
        balance: Sequence[int],
        names: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        names = list(names) if names is not None else [str(i) for i in range(len(layers))]
        places: list[torch.device] = [
            d for size, d in zip(balance, devices, strict=True) for _ in range(size)
        ]
        check_shared_state(names, layers, places)
        self.module = owner
        #: The model's name of every layer position, in order (a repeated layer repeats).
        self.layer_names: tuple[str, ...] = tuple(names)
        self.devices: tuple[torch.device, ...] = tuple(devices)
        self.balance: tuple[int, ...] = tuple(balance)
        stages: list[nn.Sequential] = []
        start = 0
        for size, device in zip(self.balance, self.devices, strict=True):
            stage = nn.Sequential(*layers[start : start + size])  # repeats kept
            stage.to(device)
            stages.append(stage)
            start += size
        # A plain list: the layers are registered once, under ``module``.
        self.partitions: list[nn.Sequential] = stages

    # -- sequence of layers, as the nn.Sequential it was built from ------------------
    def __len__(self) -> int:
        """The number of layer positions (a layer used twice counts twice)."""
        return sum(self.balance)

    def __iter__(self) -> Iterator[nn.Module]:
        """The layers in order, one per position."""
        for stage in self.partitions:
            yield from stage

    def __getitem__(self, index: int) -> nn.Module:
        """The layer at position ``index`` (negative counts from the end)."""
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(
                f"{type(self).__name__} indices are layer positions (int), got "
                f"{type(index).__name__}: use model[0], model[-1], or list(model)[a:b]"
            )
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"layer index {index} is out of range for {n} layers")
        return list(self)[index]

    @property
    def input_device(self) -> torch.device:
        """Where the first stage runs; inputs are moved here."""
        return self.devices[0]

    @property
    def output_device(self) -> torch.device:
        """Where the output lives: move labels here (``y.to(model.output_device)``)."""
        return self.devices[-1]

    def forward(self, x: object) -> Any:  # the last layer's output
        for stage, device in zip(self.partitions, self.devices, strict=True):
            x = stage(move(x, device))
        return x

    # -- canonical keys ------------------------------------------------------------
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The original model's state_dict (same keys as the plain model)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load a plain model's state_dict; tensors are copied onto each stage's device."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    # -- placement is ours -----------------------------------------------------------
    def to(self, *args: Any, **kwargs: Any) -> SplitModel:
        try:
            device, dtype, non_blocking, _fmt = torch._C._nn._parse_to(*args, **kwargs)
        except RuntimeError as exc:
            # ``.to(0)`` names a GPU; parsing it fails where there is none.
            shown = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
            raise _refuse_move(self, f".to({shown})") from exc
        if device is not None:
            raise _refuse_move(self, f".to({device})")
        if dtype is not None:
            for stage in self.partitions:
                stage.to(dtype=dtype, non_blocking=non_blocking)
        return self

    def cuda(self, device: int | torch.device | None = None) -> SplitModel:
        raise _refuse_move(self, ".cuda()")

    def cpu(self) -> SplitModel:
        raise _refuse_move(self, ".cpu()")

    def extra_repr(self) -> str:
        return f"devices={[str(d) for d in self.devices]}, balance={list(self.balance)}"


def split_model(
    module: nn.Module | Sequence[nn.Module],
    devices: Sequence[DeviceLike],
    balance: BalanceSpec = None,
    sample: object | None = None,
) -> SplitModel:
    """Place ``module``'s layers over ``devices`` (one stage per entry; entries may repeat).

    ``balance``: None = even by layer count (ResNet-50's six blocks on two devices:
    stem, layer1, layer2 | layer3, layer4, head — the seed's split); a list of layer
    counts; ``"size"`` (parameter + activation bytes; activations need ``sample``);
    ``"time"`` (profiled forward+backward on ``devices[0]`` with ``sample``).
    The layers are moved in place: the split model owns them.
    """
    owner, named = named_layers(module)
    layers = [layer for _, layer in named]
    devs = parse_devices(devices)
    counts = resolve_balance(layers, devs, balance, sample)
    return SplitModel(owner, layers, devs, counts, [name for name, _ in named])



def placed_output_device(model: nn.Module) -> torch.device | None:
    """Where ``model``'s output lives when it places its stages itself (a
    :class:`SplitModel`, a pipeline included: labels go there), else None."""
    return model.output_device if isinstance(model, SplitModel) else None
