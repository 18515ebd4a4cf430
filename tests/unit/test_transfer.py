"""to_device over nested types, pin, Prefetcher on CPU, check_devices naming offenders.

``meta`` stands in for a second device on a CPU-only machine: moving to it is a real
device change that to_device and check_devices must handle like any other. The tests
taking the ``target`` fixture move to the GPU instead when the suite runs on one
(``TORCHGPU_TEST_DEVICE=cuda``, the GPU check's tests part), and there also check that
the values survive the trip. The CUDA
paths (the Prefetcher's side stream, the device-to-host synchronise) run against
recording fakes of the CUDA stream API, which check the order of the calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import OrderedDict, defaultdict, namedtuple

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

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


@pytest.fixture
def target(run_device: torch.device) -> torch.device:
    """Where to_device moves things: the test device when it is not the CPU (a GPU), else
    meta (a real device change on a CPU-only machine, without values)."""
    return run_device if run_device.type != "cpu" else META


def devices_of(obj):
    found = []

    def walk(o):
        if isinstance(o, torch.Tensor):
            found.append(o.device.type)
        elif isinstance(o, PackedSequence):  # batch_sizes stays on the CPU by design
            for v in (o.data, o.sorted_indices, o.unsorted_indices):
                walk(v)
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


def packed_batch():
    """Two padded sequences of lengths 2 and 3 (unsorted, so the indices exist)."""
    return pack_padded_sequence(torch.randn(3, 2, 4), torch.tensor([2, 3]), enforce_sorted=False)


def test_nested_types_preserved_and_moved(target):
    t = torch.ones(2)
    packed = packed_batch()
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
        "packed": packed,
    }
    out = to_device(nested, target)
    assert type(out) is dict and out.keys() == nested.keys()
    assert type(out["pair"]) is Pair and type(out["ordered"]) is OrderedDict
    assert type(out["default"]) is defaultdict and out["default"].default_factory is list
    assert type(out["set"]) is set and type(out["frozenset"]) is frozenset
    assert type(out["batch"]) is Batch and out["batch"].label == "lbl" and out["batch"].note == 7
    assert type(out["frozen"]) is Frozen and type(out["mylist"]) is MyList
    assert out["list"][1:] == [3, "s", None] and out["object"] is object
    assert set(devices_of(out)) == {target.type}
    assert len(devices_of(out)) == len(devices_of(nested)) == 17
    moved = out["packed"]
    assert type(moved) is PackedSequence and moved.data.device.type == target.type
    assert moved.batch_sizes is packed.batch_sizes  # stays on the CPU, as .to() keeps it
    assert moved.sorted_indices.device.type == moved.unsorted_indices.device.type == target.type
    if target.type != "meta":  # a real device: the values made the trip
        assert torch.equal(out["batch"].x.cpu(), t) and torch.equal(moved.data.cpu(), packed.data)
    assert nested["plain"].device.type == "cpu"  # the input is not modified
    assert nested["batch"].x.device.type == "cpu"


def test_packed_sequence_round_trip_keeps_values(target):
    packed = packed_batch()
    there = to_device({"seq": packed}, target)["seq"]
    assert there.data.shape == packed.data.shape
    if target.type != "meta":  # there and back again, on a GPU
        back = to_device(there, "cpu")
        assert back.data.device.type == "cpu"
        torch.testing.assert_close(pad_packed_sequence(back)[0], pad_packed_sequence(packed)[0])
    same = to_device(packed, "cpu")
    assert same.data is packed.data  # already there: nothing copied
    padded, lengths = pad_packed_sequence(same)
    expected, expected_lengths = pad_packed_sequence(packed)
    assert torch.equal(padded, expected) and lengths.tolist() == expected_lengths.tolist()


class Config(dict):
    """A dict subclass whose constructor takes other arguments."""

    def __init__(self, name, items):
        super().__init__(items)
        self.name = name


def test_container_that_cannot_be_rebuilt_falls_back_to_builtin(target):
    out = to_device({"cfg": Config("c", {"x": torch.ones(1)})}, target)
    assert type(out["cfg"]) is dict and out["cfg"]["x"].device.type == target.type


def test_same_device_returns_same_tensor():
    t = torch.ones(2)
    assert to_device(t, "cpu") is t
    assert to_device([t], torch.device("cpu"))[0] is t


def test_module_moved_in_place(target):
    model = nn.Linear(2, 2)
    out = to_device({"m": model}, target)
    assert out["m"] is model and model.weight.device.type == target.type


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
    message = str(info.value)
    assert message.startswith("9 tensors are not on meta: ")
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    assert len(names) == 9
    assert all(f"{name} on cpu" in message for name in names)
    assert " more" not in message  # 9 is under the 12 that are listed in full
    assert "model.to('meta')" not in message  # moving to meta would drop the data


def test_check_devices_meta_first_layer_is_not_the_expected_device():
    model = nn.Sequential(nn.Linear(2, 2, device="meta"), nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(DeviceMismatchError) as info:
        check_devices(model, torch.zeros(1, 2))
    message = str(info.value)
    assert message.startswith("2 tensors are not on cpu: 0.weight on meta, 0.bias on meta.")
    assert "to('meta')" not in message and "'meta'" in message and "to_empty" in message


def test_check_devices_model_device_wins_over_a_stray_input():
    model = nn.Sequential(nn.Linear(2, 2, device="meta"), nn.Linear(2, 2, device="meta"))
    model.append(nn.Linear(2, 2))  # most tensors are on meta, the only real ones on cpu
    with pytest.raises(DeviceMismatchError) as info:
        check_devices(model, torch.zeros(1, 2, device=META))
    message = str(info.value)
    assert message.startswith("5 tensors are not on cpu: 0.weight on meta")
    assert "input[0] on meta" in message
    # Everything on meta has no "real" device: meta is then the answer, and consistent.
    everything = nn.Linear(2, 2, device="meta")
    assert check_devices(everything, torch.zeros(1, device=META)) == META
    # Real input, all-meta model: the input names the device, the model is reported.
    with pytest.raises(DeviceMismatchError, match=r"^2 tensors are not on cpu: weight on meta"):
        check_devices(everything, torch.zeros(1, 2))


def test_check_devices_packed_sequence_input_ignores_batch_sizes():
    model = nn.LSTM(4, 3).to(META)
    packed = to_device(packed_batch(), META)
    assert packed.batch_sizes.device.type == "cpu"
    assert check_devices(model, packed) == META  # batch_sizes is on the CPU by design
    with pytest.raises(DeviceMismatchError) as info:
        check_devices(model, packed_batch(), device=META)
    message = str(info.value)
    assert message.startswith("3 tensors are not on meta: ")
    assert "input[0].data on cpu" in message and "input[0].sorted_indices on cpu" in message
    assert "batch_sizes" not in message


def test_check_devices_many_offenders_summarised():
    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(10)])
    with pytest.raises(DeviceMismatchError, match="and 8 more"):
        check_devices(model, device=META)


# ------------------------------------------------- CUDA paths against recording fakes
class FakeStream:
    def __init__(self, name, log):
        self.name = name
        self.log = log

    def wait_stream(self, other):
        self.log.append(("wait", self.name, other.name))

    def synchronize(self):
        self.log.append(("sync", self.name))


class FakeCuda:
    """Stands in for a CUDA GPU: torch.cuda.Stream/stream/current_stream and the tensor
    methods the Prefetcher uses, each call appended to ``log`` with tensor labels.

    A "copy to the GPU" (``Tensor.to``) returns a clone that ``is_cuda`` reports as on
    the GPU and that keeps its source's label; ``log`` records which stream context was
    active when each copy was issued.
    """

    def __init__(self, monkeypatch):
        self.log = []
        self.labels = {}  # id(tensor) -> label; tensors kept alive in self.keep
        self.keep = []
        self.on_gpu = set()
        self.compute = FakeStream("compute", self.log)
        self.active = None
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        monkeypatch.setattr(torch.version, "cuda", "12.4")
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "Stream", self.make_stream)
        monkeypatch.setattr(torch.cuda, "stream", self.stream)
        monkeypatch.setattr(torch.cuda, "current_stream", self.current_stream)
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: id(t) in self.on_gpu))
        monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t, *a: False)
        # plain functions, so that they bind to the tensor as methods do
        monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *a: self.pin_memory(t))
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: self.record_stream(t, s))
        monkeypatch.setattr(torch.Tensor, "to", lambda t, *a, **k: self.copy(t, *a, **k))

    def label(self, tensor, name):
        self.labels[id(tensor)] = name
        self.keep.append(tensor)
        return tensor

    def make_stream(self, device=None, **_kwargs):
        assert device == torch.device("cuda", 0)
        self.log.append(("new-stream",))
        return FakeStream("side", self.log)

    @contextlib.contextmanager
    def stream(self, stream):
        self.log.append(("enter", stream.name))
        previous, self.active = self.active, stream
        try:
            yield
        finally:
            self.active = previous
            self.log.append(("exit", stream.name))

    def current_stream(self, device=None):
        return self.active or self.compute

    def pin_memory(self, tensor):
        self.log.append(("pin", self.labels[id(tensor)]))
        return tensor

    def record_stream(self, tensor, stream):
        assert id(tensor) in self.on_gpu
        self.log.append(("record", self.labels[id(tensor)], stream.name))

    def copy(self, tensor, device, non_blocking=False):
        assert device == torch.device("cuda", 0)
        name = self.labels[id(tensor)]
        where = self.active.name if self.active else "compute"
        self.log.append(("copy", name, where, non_blocking))
        out = self.label(tensor.clone(), name)
        self.on_gpu.add(id(out))
        return out


def test_prefetcher_cuda_path_orders_stream_calls(monkeypatch):
    fake = FakeCuda(monkeypatch)
    batches = [
        (fake.label(torch.full((2,), float(k)), f"x{k}"), fake.label(torch.tensor([k]), f"y{k}"))
        for k in range(3)
    ]
    log = fake.log
    got = []
    for k, batch in enumerate(Prefetcher(batches, "cuda:0")):
        log.append(("yield", k))
        got.append(batch)

    def load(k):  # pin and copy batch k on the side stream
        return [
            ("enter", "side"),
            ("pin", f"x{k}"),
            ("pin", f"y{k}"),
            ("copy", f"x{k}", "side", True),
            ("copy", f"y{k}", "side", True),
            ("exit", "side"),
        ]

    def hand_over(k):  # compute waits for the copy; the allocator learns the new user
        return [
            ("wait", "compute", "side"),
            ("record", f"x{k}", "compute"),
            ("record", f"y{k}", "compute"),
        ]

    expected = [("new-stream",), *load(0)]
    for k in range(3):
        expected += hand_over(k)
        if k + 1 < 3:
            expected += load(k + 1)  # batch k+1 queued before batch k is handed over
        expected.append(("yield", k))
    assert log == expected
    assert [type(b) for b in got] == [tuple] * 3
    assert all(id(t) in fake.on_gpu for b in got for t in b)
    assert [b[0].tolist() for b in got] == [[k, k] for k in range(3)]


def test_prefetcher_cuda_path_records_every_nested_tensor(monkeypatch):
    packed = packed_batch()
    fake = FakeCuda(monkeypatch)
    fake.label(packed.data, "seq.data")
    fake.label(packed.sorted_indices, "seq.sorted")
    fake.label(packed.unsorted_indices, "seq.unsorted")
    fake.label(packed.batch_sizes, "seq.batch_sizes")
    batch = {"x": fake.label(torch.ones(2), "x"), "pair": Pair(fake.label(torch.ones(1), "p"), 3)}
    batch["seq"] = packed
    (out,) = list(Prefetcher([batch], "cuda:0"))
    copies = [e for e in fake.log if e[0] == "copy"]
    records = {e[1] for e in fake.log if e[0] == "record"}
    expected = {"x", "p", "seq.data", "seq.sorted", "seq.unsorted"}
    assert {e[1] for e in copies} == expected and all(e[2:] == ("side", True) for e in copies)
    assert records == expected  # batch_sizes stays on the CPU: neither copied nor recorded
    assert type(out["pair"]) is Pair and out["pair"].y == 3
    assert type(out["seq"]) is PackedSequence and out["seq"].batch_sizes is packed.batch_sizes
    wait = fake.log.index(("wait", "compute", "side"))
    assert wait > max(fake.log.index(e) for e in copies)
    assert wait < min(i for i, e in enumerate(fake.log) if e[0] == "record")


class FakeSources:
    """Tensors that report a GPU/MPS device, and a copy that logs; for to_device(..., cpu)."""

    def __init__(self, monkeypatch):
        self.log = []
        self.device_of = {}
        self.keep = []
        real_device = torch.Tensor.device
        monkeypatch.setattr(
            torch.Tensor,
            "device",
            property(lambda t: self.device_of.get(id(t)) or real_device.__get__(t)),
        )
        monkeypatch.setattr(torch.Tensor, "to", lambda t, *a, **k: self.copy(t, *a, **k))
        monkeypatch.setattr(
            torch.cuda,
            "current_stream",
            lambda device=None: FakeStream(f"current:{device}", self.log),
        )
        monkeypatch.setattr(torch.mps, "synchronize", lambda: self.log.append(("sync", "mps")))

    def on(self, device, value):
        tensor = torch.full((2,), float(value))
        self.device_of[id(tensor)] = torch.device(device)
        self.keep.append(tensor)
        return tensor

    def copy(self, tensor, device, non_blocking=False):
        self.log.append(("copy", str(self.device_of[id(tensor)]), str(device), non_blocking))
        return tensor.clone()


def test_async_copy_to_cpu_synchronises_each_source_before_returning(monkeypatch):
    fake = FakeSources(monkeypatch)
    batch = {"a": fake.on("cuda:0", 1), "b": [fake.on("cuda:0", 2), fake.on("cuda:1", 3)]}
    batch["c"] = fake.on("mps", 4)
    out = to_device(batch, "cpu", non_blocking=True)
    copies, syncs = fake.log[:4], fake.log[4:]
    assert all(c[0] == "copy" and c[2:] == ("cpu", True) for c in copies)
    # after every copy was queued, one synchronise per source device, none before
    assert sorted(syncs) == [
        ("sync", "current:cuda:0"),
        ("sync", "current:cuda:1"),
        ("sync", "mps"),
    ]
    assert [out["a"].tolist(), out["b"][1].tolist(), out["c"].tolist()] == [[1, 1], [3, 3], [4, 4]]


@pytest.mark.parametrize("non_blocking", [False, "auto"])
def test_blocking_copy_to_cpu_needs_no_synchronise(monkeypatch, non_blocking):
    fake = FakeSources(monkeypatch)
    to_device([fake.on("cuda:0", 1), fake.on("mps", 2)], "cpu", non_blocking=non_blocking)
    assert fake.log == [("copy", "cuda:0", "cpu", False), ("copy", "mps", "cpu", False)]
