"""to_device over nested types, pin, Prefetcher on CPU, check_devices naming offenders.

``meta`` stands in for a second device on a CPU-only machine: moving to it is a real
device change that to_device and check_devices must handle like any other.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, defaultdict, namedtuple

import pytest
import torch
from torch import nn

from torchgpu.errors import DeviceMismatchError
from torchgpu.transfer import Prefetcher, check_devices, pin, to_device

META = torch.device("meta")
Pair = namedtuple("Pair", "x y")


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    label: str
    extra: dict = dataclasses.field(default_factory=dict)
    note: int = dataclasses.field(default=7, init=False)


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor


class MyList(list):
    pass


def devices_of(obj):
    found = []

    def walk(o):
        if isinstance(o, torch.Tensor):
            found.append(o.device.type)
        elif dataclasses.is_dataclass(o):
            for f in dataclasses.fields(o):
                walk(getattr(o, f.name))
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple, set, frozenset)):
            for v in o:
                walk(v)

    walk(obj)
    return found


def test_nested_types_preserved_and_moved():
    t = torch.ones(2)
    nested = {
        "plain": t,
        "list": [t, 3, "s", None],
        "tuple": (t, (t,)),
        "pair": Pair(t, [t]),
        "ordered": OrderedDict(a=t),
        "default": defaultdict(list, b=t),
        "set": {t},
        "frozenset": frozenset({t}),
        "batch": Batch(t, "lbl", {"k": t}),
        "frozen": Frozen(t),
        "mylist": MyList([t]),
        "object": object,
    }
    out = to_device(nested, META)
    assert type(out) is dict and out.keys() == nested.keys()
    assert type(out["pair"]) is Pair and type(out["ordered"]) is OrderedDict
    assert type(out["default"]) is defaultdict and out["default"].default_factory is list
    assert type(out["set"]) is set and type(out["frozenset"]) is frozenset
    assert type(out["batch"]) is Batch and out["batch"].label == "lbl" and out["batch"].note == 7
    assert type(out["frozen"]) is Frozen and type(out["mylist"]) is MyList
    assert out["list"][1:] == [3, "s", None] and out["object"] is object
    assert set(devices_of(out)) == {"meta"}
    assert len(devices_of(out)) == len(devices_of(nested)) == 14
    assert nested["plain"].device.type == "cpu"  # the input is not modified
    assert nested["batch"].x.device.type == "cpu"


def test_same_device_returns_same_tensor():
    t = torch.ones(2)
    assert to_device(t, "cpu") is t
    assert to_device([t], torch.device("cpu"))[0] is t


def test_module_moved_in_place():
    model = nn.Linear(2, 2)
    out = to_device({"m": model}, META)
    assert out["m"] is model and model.weight.device == META


def test_device_string_validated():
    from torchgpu.errors import DeviceSpecError

    with pytest.raises(DeviceSpecError):
        to_device(torch.ones(1), "gpu")


@pytest.mark.parametrize(
    ("pinned", "non_blocking", "expected"),
    [(True, "auto", True), (False, "auto", False), (True, False, False), (False, True, True)],
)
def test_non_blocking_only_where_safe(monkeypatch, pinned, non_blocking, expected):
    calls = []
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: pinned)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: calls.append((a, k)) or self)
    to_device(torch.ones(1), torch.device("cuda", 0), non_blocking=non_blocking)
    assert calls == [((torch.device("cuda", 0),), {"non_blocking": expected})]


def test_pin_is_noop_without_cuda():
    obj = {"x": torch.ones(2)}
    out = pin(obj)
    assert out["x"] is obj["x"] or out["x"].is_pinned()


def test_prefetcher_on_cpu_is_pass_through():
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.arange(10.0), torch.arange(10)), batch_size=4
    )
    pre = Prefetcher(loader, "cpu")
    assert len(pre) == 3
    batches = list(pre)
    assert [b[0].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert all(b[0].device.type == "cpu" for b in batches)
    assert next(iter(pre))[1].tolist() == [0, 1, 2, 3]  # iterable again


def test_prefetcher_len_of_unsized():
    pre = Prefetcher(iter([1, 2]), "cpu")
    with pytest.raises(TypeError):
        len(pre)
    assert list(pre) == [1, 2]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = nn.Linear(4, 4)
        self.layer2 = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))


def test_check_devices_clean_returns_device():
    model = Net()
    assert check_devices(model, torch.ones(2, 4)) == torch.device("cpu")
    assert check_devices(model, device="cpu") == torch.device("cpu")
    assert check_devices(nn.ReLU()) == torch.device("cpu")


def test_check_devices_names_meta_layer():
    model = Net()
    model.layer2[0].to(META)
    with pytest.raises(DeviceMismatchError) as info:
        check_devices(model, torch.ones(2, 4))
    message = str(info.value)
    assert message.startswith("2 tensors are not on cpu: ")
    assert "layer2.0.weight on meta, layer2.0.bias on meta" in message
    assert "layer1" not in message and "layer2.1" not in message
    assert "to_empty" in message and "model.to('cpu')" in message


def test_check_devices_names_inputs_and_buffers():
    model = Net()
    inputs = ({"x": torch.ones(1, device=META)}, [torch.ones(1), torch.ones(1, device=META)])
    model.layer2[1].running_mean = model.layer2[1].running_mean.to(META)
    with pytest.raises(DeviceMismatchError) as info:
        check_devices(model, *inputs)
    message = str(info.value)
    assert "layer2.1.running_mean on meta" in message
    assert "input[0]['x'] on meta" in message and "input[1][1] on meta" in message
    assert "input[1][0]" not in message


def test_check_devices_expected_device_given():
    model = Net()
    with pytest.raises(DeviceMismatchError) as info:
        check_devices(model, device=META)
    assert "layer1.weight on cpu" in str(info.value)
    assert "and " in str(info.value)  # 9 tensors: more than shown are summarised or listed


def test_check_devices_many_offenders_summarised():
    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(10)])
    with pytest.raises(DeviceMismatchError, match="and 8 more"):
        check_devices(model, device=META)
