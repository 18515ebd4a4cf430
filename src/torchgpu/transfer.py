"""Moving things between devices, and telling what is where.

- :func:`to_device` moves tensors and modules inside any nesting of dict, list, tuple,
  namedtuple, dataclass and set, keeping the container types (a ``PackedSequence`` is
  moved as ``PackedSequence.to`` does: ``batch_sizes`` stays on the CPU); any other
  object with a ``.to()`` method (a custom batch class, a graph ``Data`` object) is
  moved by its own ``.to()``, as Accelerate's ``send_to_device`` does.
- :func:`pin` puts nested CPU tensors in page-locked memory (needed for truly async
  host-to-GPU copies).
- :class:`Prefetcher` copies the next batch to the GPU on a side stream while the current
  one is being used.
- :func:`check_devices` names every parameter, buffer and input that is on the wrong
  device, instead of torch's "Expected all tensors to be on the same device".
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from typing import Any, Generic, Literal, Protocol, TypeGuard, TypeVar

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from torchgpu.devices import get_device, placement_device
from torchgpu.devices.cuda_status import cuda_device_count, cuda_initialized
from torchgpu.errors import DeviceMismatchError

T = TypeVar("T")
DeviceLike = str | int | torch.device
NonBlocking = bool | Literal["auto"]


class _Movable(Protocol):
    """An object that moves itself: ``obj.to(device, non_blocking=...)``."""

    def to(self, device: torch.device, /, **kwargs: bool) -> object: ...


def _movable(obj: object) -> TypeGuard[_Movable]:
    """True for an object that moves itself: it has a callable ``.to`` (and is not a
    container or a type; ``nn.Module`` and tensors are handled before)."""
    return not isinstance(obj, type) and callable(getattr(obj, "to", None))


def _map(
    obj: object,
    fn: Callable[[torch.Tensor], torch.Tensor],
    on_module: Callable[[nn.Module], nn.Module],
    on_movable: Callable[[_Movable], object] | None = None,
) -> Any:  # obj's structure rebuilt: its type is only known at run time
    """Apply ``fn`` to every tensor (and ``on_module`` to every module) in ``obj``,
    rebuilding containers with their own types. ``on_movable`` (when given) takes any
    other object with a ``.to()`` method, containers with one included; other objects
    pass through."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, nn.Module):
        return on_module(obj)
    if isinstance(obj, (str, bytes)):
        return obj
    if on_movable is not None and not isinstance(obj, PackedSequence) and _movable(obj):
        return on_movable(obj)
    if isinstance(obj, PackedSequence):
        # A namedtuple whose constructor refuses batch_sizes off the CPU: it stays where
        # it is, as PackedSequence.to leaves it; the indices follow the data.
        sorted_indices, unsorted_indices = obj.sorted_indices, obj.unsorted_indices
        return type(obj)(
            fn(obj.data),
            obj.batch_sizes,
            None if sorted_indices is None else fn(sorted_indices),
            None if unsorted_indices is None else fn(unsorted_indices),
        )
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy.copy(obj)
        for f in dataclasses.fields(obj):
            # object.__setattr__ also works on frozen dataclasses; fields with init=False
            # are kept too, which dataclasses.replace would drop.
            object.__setattr__(new, f.name, _map(getattr(obj, f.name), fn, on_module, on_movable))
        return new
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_map(v, fn, on_module, on_movable) for v in obj))
    if isinstance(obj, defaultdict):
        out: defaultdict[Any, Any] = type(obj)(obj.default_factory)
        out.update((k, _map(v, fn, on_module, on_movable)) for k, v in obj.items())
        return out
    if isinstance(obj, Mapping):
        items = [(k, _map(v, fn, on_module, on_movable)) for k, v in obj.items()]
        mapping_type: Callable[..., object] = type(obj)
        try:
            return mapping_type(items)
        except TypeError:
            return dict(items)
    if isinstance(obj, (list, tuple, set, frozenset)):
        values = [_map(v, fn, on_module, on_movable) for v in obj]
        try:
            return type(obj)(values)
        except TypeError:
            return type(obj).__mro__[-2](values)  # the builtin base: list, tuple, set...
    return obj


def to_device(obj: T, device: DeviceLike, non_blocking: NonBlocking = "auto") -> T:
    """``obj`` with every tensor moved to ``device`` and every module moved in place.

    Containers are rebuilt with their own type (a ``Mapping`` such as ``UserDict`` or
    ``OrderedDict`` stays one); one whose constructor does not take an iterable of items
    (a dict or list subclass with extra ``__init__`` arguments) comes back as its builtin
    base (``dict``, ``list``...). Any other object with a ``.to()`` method (a custom
    batch class, torch_geometric's ``Data``, transformers' ``BatchEncoding``) is moved
    by ``obj.to(device, non_blocking=...)``, or ``obj.to(device)`` when its ``.to`` does
    not take ``non_blocking``; its result replaces it, unless ``.to`` returned ``None``
    (it moved in place), and a module is always kept itself. Everything else (numbers,
    strings, None) passes through.

    ``device`` is anything ``torch.device`` accepts, ``meta`` included, or ``auto`` /
    ``N`` (a GPU index) as :func:`torchgpu.get_device` reads them
    (:func:`torchgpu.devices.placement_device`); a CUDA index torch does not have is
    refused before anything moves (DeviceSpecError, or NoDeviceError without CUDA).

    ``non_blocking="auto"`` copies asynchronously only where it is safe and useful: a
    pinned CPU tensor going to CUDA. The copy may still be running when this returns,
    so do not modify a pinned source (e.g. refill a reused pinned buffer) until the
    stream has synchronised. ``True`` asks for async copies everywhere; copies to the
    CPU from a CUDA or MPS device are then synchronised before returning, so a returned
    CPU tensor is never read before its data has arrived. ``False`` always blocks.
    """
    target = placement_device(device)
    if target.type == "cuda" and target.index is None:
        target = get_device("cuda")
    pending_d2h: set[torch.device] = set()
    # An object's own .to() gets a plain bool: "auto" cannot see inside it, so it blocks.
    object_nb = non_blocking is True

    def move(t: torch.Tensor) -> torch.Tensor:
        if t.device == target:
            return t
        if non_blocking == "auto":
            nb = t.device.type == "cpu" and target.type == "cuda" and t.is_pinned()
        else:
            nb = bool(non_blocking)
        if nb and target.type == "cpu" and t.device.type in ("cuda", "mps"):
            pending_d2h.add(t.device)
        return t.to(target, non_blocking=nb)

    def move_module(m: nn.Module) -> nn.Module:
        # Modules move in place; a subclass's .to() override may return nothing.
        m.to(target)
        return m

    def move_object(o: _Movable) -> object:
        try:
            moved = o.to(target, non_blocking=object_nb)
        except TypeError:  # a .to() without the non_blocking keyword
            moved = o.to(target)
        else:
            if object_nb and target.type == "cpu":
                # Its tensors' sources are unknown: wait for every queued CUDA copy.
                pending_d2h.update(_current_cuda_device())
        # A .to() that moves in place and returns None keeps the object, as Lightning's
        # move_data_to_device does.
        return o if moved is None else moved

    result: T = _map(obj, move, move_module, move_object)
    for source in pending_d2h:
        # The async device-to-host copies were queued on the source's current stream.
        if source.type == "mps":
            torch.mps.synchronize()
        else:
            torch.cuda.current_stream(source).synchronize()
    return result


def _current_cuda_device() -> set[torch.device]:
    """The current CUDA device, if CUDA is running in this process (else nothing)."""
    if not cuda_initialized():
        return set()
    return {torch.device("cuda", torch.cuda.current_device())}


def pin(obj: T) -> T:
    """``obj`` with nested CPU tensors in pinned (page-locked) memory.

    Already pinned or non-CPU tensors are returned as they are. A no-op where no CUDA
    GPU is usable (pinning needs the driver), so code stays device-agnostic.
    """
    if torch.version.cuda is None or cuda_device_count() == 0:
        return obj

    def pin_one(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu" or t.is_pinned():
            return t
        return t.pin_memory()

    result: T = _map(obj, pin_one, lambda m: m)
    return result


class Prefetcher(Generic[T]):
    """Iterate ``loader`` with each batch already on ``device``.

    On CUDA, batch k+1 is pinned and copied with ``non_blocking=True`` on a side stream
    while the caller computes on batch k; before a batch is handed out, the compute
    stream waits for its copy (``wait_stream``) and each tensor is ``record_stream``-ed
    on the compute stream so the caching allocator does not reuse its memory while
    kernels still read it. Pinning happens in this thread; a DataLoader with
    ``pin_memory=True`` does it in a helper thread instead (then pinning here is free).
    On CPU and MPS it is a plain pass-through (batches moved with :func:`to_device`).
    ``len()`` is the loader's.
    """

    def __init__(self, loader: Iterable[T], device: DeviceLike | None = None) -> None:
        self.loader = loader
        self.device = placement_device("auto" if device is None else device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = get_device("cuda")

    def __len__(self) -> int:
        if not isinstance(self.loader, Sized):
            raise TypeError(f"{type(self.loader).__name__} has no len()")
        return len(self.loader)

    def __iter__(self) -> Iterator[T]:
        if self.device.type != "cuda":
            for batch in self.loader:
                yield to_device(batch, self.device)
            return
        yield from self._cuda_iter()

    def _cuda_iter(self) -> Iterator[T]:
        side = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        iterator = iter(self.loader)

        def preload() -> list[T]:
            """The next batch, queued to the device ([] when the loader is exhausted)."""
            try:
                batch = next(iterator)
            except StopIteration:
                return []
            with torch.cuda.stream(side):
                return [to_device(pin(batch), self.device, non_blocking=True)]

        upcoming = preload()
        while upcoming:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(side)
            batch = upcoming[0]
            _record_stream(batch, compute)
            upcoming = preload()  # queued now, so it overlaps the caller's compute
            yield batch


def _record_stream(batch: object, stream: torch.cuda.Stream) -> None:
    """Tell the caching allocator each tensor of ``batch`` is used on ``stream``."""

    def record(t: torch.Tensor) -> torch.Tensor:
        if t.is_cuda:
            t.record_stream(stream)
        return t

    _map(batch, record, lambda m: m)


# ---------------------------------------------------------------- check_devices
def _same(actual: torch.device, expected: torch.device) -> bool:
    if actual.type != expected.type:
        return False
    if expected.index is None or actual.index is None:
        return True
    return actual.index == expected.index


def _input_tensors(obj: object, path: str, out: list[tuple[str, torch.Tensor]]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append((path, obj))
    elif isinstance(obj, PackedSequence):  # batch_sizes lives on the CPU by design
        for name in ("data", "sorted_indices", "unsorted_indices"):
            _input_tensors(getattr(obj, name), f"{path}.{name}", out)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _input_tensors(getattr(obj, f.name), f"{path}.{f.name}", out)
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):
        for name in obj._fields:
            _input_tensors(getattr(obj, name), f"{path}.{name}", out)
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            _input_tensors(value, f"{path}[{key!r}]", out)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _input_tensors(value, f"{path}[{i}]", out)


def _expected_device(
    named: list[tuple[str, torch.Tensor]], given: list[tuple[str, torch.Tensor]]
) -> torch.device:
    """The device the tensors should agree on, never ``meta`` while real data exists.

    The model's most common device first (a forgotten input is the usual mistake, and
    the fix is then to move the input, not the model), ties going to the first seen;
    else the first input's device. ``meta`` tensors hold no data, so they are only the
    answer when everything is on ``meta``.
    """
    counts = Counter(t.device for _, t in named if t.device.type != "meta")
    if counts:
        return counts.most_common(1)[0][0]  # sorted stably: ties keep first-seen order
    real_inputs = [t.device for _, t in given if t.device.type != "meta"]
    if real_inputs:
        return real_inputs[0]
    everything = named + given
    return everything[0][1].device if everything else torch.device("cpu")


def _fix(expected: torch.device, wrong: list[tuple[str, torch.device]]) -> str:
    if expected.type == "meta":
        # Moving to meta would throw the data away: never suggest it.
        return (
            "'meta' tensors hold no data: build these under `with torch.device('meta'):` "
            "as well, or check against the device the data should be on (device=...)"
        )
    fix = f"move them with model.to({str(expected)!r}) and to_device(inputs, {str(expected)!r})"
    if any(d.type == "meta" for _, d in wrong):
        fix += (
            "; tensors on 'meta' have no data (the module was built under "
            "torch.device('meta')): materialise them with module.to_empty(device=...) and "
            "then load or initialise the weights"
        )
    return fix


def check_devices(
    model: nn.Module, *inputs: object, device: DeviceLike | None = None
) -> torch.device:
    """Check that every parameter, buffer and input tensor is on one device; return it.

    ``device``: the expected device. By default, the device most of the model's
    parameters and buffers are on, else the first input's; ``meta`` (no data) is chosen
    only when every tensor is on it. Raises DeviceMismatchError naming every offender,
    e.g. ``layer2.0.weight on cpu, input[0] on cuda:0``, with the fix. Reads only
    ``.device`` attributes: no copies, no CUDA initialisation. A model split over
    several devices on purpose (model/pipeline parallel) should be checked per stage.
    """
    named: list[tuple[str, torch.Tensor]] = list(model.named_parameters())
    named += list(model.named_buffers())
    given: list[tuple[str, torch.Tensor]] = []
    for i, value in enumerate(inputs):
        _input_tensors(value, f"input[{i}]", given)
    expected = _expected_device(named, given) if device is None else placement_device(device)
    wrong = [(n, t.device) for n, t in named + given if not _same(t.device, expected)]
    if not wrong:
        return expected
    shown = ", ".join(f"{n} on {d}" for n, d in wrong[:12])
    more = f" and {len(wrong) - 12} more" if len(wrong) > 12 else ""
    count = len(wrong)
    raise DeviceMismatchError(
        f"{count} tensor{'s are' if count != 1 else ' is'} not on {expected}: {shown}{more}. "
        f"Fix: {_fix(expected, wrong)}."
    )
