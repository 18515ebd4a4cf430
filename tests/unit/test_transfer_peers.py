"""to_device and default_device against what peers do: Accelerate's ``send_to_device``
cases (tuples, lists, dicts, namedtuples, ``UserDict`` kept as their types, non-tensor
leaves untouched), objects that move with their own ``.to()``, and any device torch
accepts (``meta`` for deferred initialisation) while unknown or missing devices fail
clearly before anything moves.
"""

from __future__ import annotations

from collections import OrderedDict, UserDict, namedtuple
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
from torch import nn

from torchgpu.devices import default_device, placement_device
from torchgpu.errors import DeviceSpecError, NoDeviceError
from torchgpu.transfer import check_devices, to_device

ExampleNamedTuple = namedtuple("ExampleNamedTuple", "a b c")


def on_meta(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "meta"


# ------------------------------------------------ Accelerate's send_to_device cases
def test_tensor_and_tuple_with_list_and_number():
    tensor = torch.randn(5, 2)
    assert on_meta(to_device(tensor, "meta"))
    result = to_device((tensor, [tensor, tensor], 1), "meta")
    assert isinstance(result, tuple)
    assert on_meta(result[0])
    assert isinstance(result[1], list)
    assert all(on_meta(t) for t in result[1])
    assert result[2] == 1


def test_dict_keeps_keys_and_leaves():
    tensor = torch.randn(5, 2)
    result = to_device({"a": tensor, "b": [tensor, tensor], "c": 1}, "meta")
    assert type(result) is dict
    assert on_meta(result["a"])
    assert isinstance(result["b"], list) and all(on_meta(t) for t in result["b"])
    assert result["c"] == 1


def test_namedtuple_kept():
    tensor = torch.randn(5, 2)
    result = to_device(ExampleNamedTuple(a=tensor, b=[tensor, tensor], c=1), "meta")
    assert isinstance(result, ExampleNamedTuple)
    assert on_meta(result.a)
    assert isinstance(result.b, list) and all(on_meta(t) for t in result.b)
    assert result.c == 1


def test_userdict_and_ordereddict_kept():
    tensor = torch.randn(5, 2)
    result = to_device(UserDict({"a": tensor, "b": [tensor, tensor], "c": 1}), "meta")
    assert isinstance(result, UserDict)
    assert on_meta(result["a"]) and all(on_meta(t) for t in result["b"])
    assert result["c"] == 1
    ordered = to_device(OrderedDict([("z", tensor), ("a", 2)]), "meta")
    assert type(ordered) is OrderedDict
    assert list(ordered) == ["z", "a"] and on_meta(ordered["z"])


class ReadOnlyMapping(Mapping[str, Any]):
    """A Mapping that is not a dict: built from an iterable of pairs."""

    def __init__(self, items: Any = ()) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


def test_mapping_subclass_kept_as_its_type():
    result = to_device(ReadOnlyMapping({"x": torch.ones(2), "n": 3}), "meta")
    assert type(result) is ReadOnlyMapping
    assert on_meta(result["x"]) and result["n"] == 3


def test_non_tensor_leaves_untouched():
    leaves = [1, 2.5, "text", b"bytes", None, True]
    marker = object()
    result = to_device({"leaves": leaves, "obj": marker, "t": torch.zeros(1)}, "meta")
    assert result["leaves"] == leaves
    assert result["obj"] is marker
    assert on_meta(result["t"])


# ---------------------------------------------------------- objects with .to()
class Batch:
    """A custom batch class that moves itself, with the full .to signature."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x
        self.calls: list[tuple[torch.device, bool]] = []

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        moved = Batch(self.x.to(device, non_blocking=non_blocking))
        moved.calls = [*self.calls, (device, non_blocking)]
        return moved


class GraphData:
    """Like torch_geometric's Data in an older version: .to(device) only."""

    def __init__(self, edge_index: torch.Tensor) -> None:
        self.edge_index = edge_index

    def to(self, device: torch.device) -> GraphData:
        return GraphData(self.edge_index.to(device))


class EncodingDict(UserDict):  # type: ignore[type-arg]
    """Like transformers' BatchEncoding: a mapping whose own .to() must be used."""

    moved_by_own_to = False

    def to(self, device: torch.device, non_blocking: bool = False) -> EncodingDict:
        out = EncodingDict({k: v.to(device) for k, v in self.data.items()})
        out.moved_by_own_to = True
        return out


def test_custom_batch_moved_by_its_to_with_non_blocking():
    batch = Batch(torch.ones(3))
    moved = to_device(batch, "meta", non_blocking=True)
    assert isinstance(moved, Batch) and on_meta(moved.x)
    assert moved.calls == [(torch.device("meta"), True)]
    # "auto" cannot look inside the object: it asks for a blocking copy.
    assert to_device(batch, "meta").calls == [(torch.device("meta"), False)]


def test_to_without_non_blocking_falls_back():
    graph = GraphData(torch.tensor([[0, 1], [1, 0]]))
    moved = to_device([graph, {"g": graph}], "meta", non_blocking=True)
    assert on_meta(moved[0].edge_index) and on_meta(moved[1]["g"].edge_index)


def test_mapping_with_its_own_to_uses_it():
    moved = to_device(EncodingDict({"input_ids": torch.ones(2, dtype=torch.long)}), "meta")
    assert isinstance(moved, EncodingDict) and moved.moved_by_own_to
    assert on_meta(moved["input_ids"])


class InPlaceBatch:
    """A batch whose .to() moves its tensors in place and returns nothing."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def to(self, device: torch.device, non_blocking: bool = False) -> None:
        self.x = self.x.to(device, non_blocking=non_blocking)


class InPlaceGraph:
    """The same with a .to(device) that takes no non_blocking."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def to(self, device: torch.device) -> None:
        self.x = self.x.to(device)


class QuietModule(nn.Linear):
    """A module whose .to() override forgets to return self."""

    def to(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        super().to(*args, **kwargs)


@pytest.mark.parametrize("non_blocking", [True, "auto"])
def test_in_place_to_keeps_the_object(non_blocking):
    batch, graph = InPlaceBatch(torch.ones(2)), InPlaceGraph(torch.ones(2))
    layer = QuietModule(2, 2)
    moved = to_device({"b": batch, "g": [graph], "m": layer}, "meta", non_blocking=non_blocking)
    assert moved["b"] is batch and on_meta(batch.x)
    assert moved["g"][0] is graph and on_meta(graph.x)
    assert moved["m"] is layer and on_meta(layer.weight)
    assert to_device(InPlaceBatch(torch.ones(1)), "meta") is not None


def test_module_still_moved_in_place():
    layer = nn.Linear(2, 2)
    assert to_device(layer, "meta") is layer
    assert layer.weight.device.type == "meta"


# --------------------------------------------------------------- device specs
@pytest.mark.parametrize("spec", ["meta", "cpu", "cpu:0", torch.device("meta")])
def test_any_device_torch_accepts(spec):
    assert placement_device(spec) == torch.device(spec)
    assert to_device(torch.ones(1), spec).device.type == torch.device(spec).type


def test_default_device_meta_defers_allocation():
    with default_device("meta") as dev:
        layer = nn.Linear(1000, 1000)
    assert dev == torch.device("meta")
    assert layer.weight.device.type == "meta"
    assert torch.empty(1).device.type == "cpu"  # restored


@pytest.mark.parametrize("spec", ["gpu", "cuda:-1", " cpu", 1.5, True])
def test_unknown_device_refused_clearly(spec):
    with pytest.raises(DeviceSpecError, match="device"):
        to_device(torch.ones(1), spec)
    with pytest.raises(DeviceSpecError), default_device(spec):
        pass


def test_missing_cuda_device_fails_before_moving(monkeypatch):
    from torchgpu.devices import spec

    monkeypatch.setattr(spec, "cuda_unavailable_reason", lambda: "")
    monkeypatch.setattr(spec, "cuda_device_count", lambda: 2)
    layer = nn.Linear(2, 2)
    with pytest.raises(DeviceSpecError, match=r"cuda:7 requested but 2 GPUs are visible"):
        to_device([torch.ones(1), layer], "cuda:7")
    assert layer.weight.device.type == "cpu"  # nothing moved


def test_cuda_without_cuda_is_a_no_device_error(monkeypatch):
    from torchgpu.devices import spec

    monkeypatch.setattr(spec, "cuda_unavailable_reason", lambda: "no driver here")
    with pytest.raises(NoDeviceError, match="no driver here"):
        to_device(torch.ones(1), "cuda:0")


def test_check_devices_against_meta_by_name():
    with torch.device("meta"):
        model = nn.Linear(2, 2)
    assert check_devices(model, torch.ones(1, 2, device="meta"), device="meta").type == "meta"
