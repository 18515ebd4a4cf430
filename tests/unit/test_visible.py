"""CUDA_VISIBLE_DEVICES / CUDA_DEVICE_ORDER rules, table-driven."""

from __future__ import annotations

import pytest

from torchgpu.devices.visible import (
    PhysicalGpu,
    cuda_enumeration,
    map_visible,
    parse_visible_devices,
    validate_visible_devices,
)

U0 = "GPU-aaaa1111-0000"
U1 = "GPU-aaaa2222-0000"
U2 = "GPU-bbbb3333-0000"


@pytest.mark.parametrize(
    ("value", "count", "ids", "dropped", "clean"),
    [
        (None, None, (), (), True),
        ("", None, (), (), True),
        ("0", None, (0,), (), True),
        ("1,2", None, (1, 2), (), True),
        ("0, 2", None, (0, 2), (), True),  # leading blanks are skipped (strtoul)
        ("0,,1", None, (0,), ("", "1"), False),
        ("0 1", None, (0,), (" 1",), False),  # "0 1" reads as 0, the rest ignored
        ("0;1", None, (0,), (";1",), False),
        ("0,-1,1", None, (0,), ("-1", "1"), False),
        ("-1", None, (), ("-1",), False),
        ("all", None, (), ("all",), False),
        ("0,0", None, (), ("0", "0"), False),
        ("1,0,1", None, (), ("1", "0", "1"), False),
        ("1gpu", None, (1,), ("gpu",), False),
        ("0,7,1", 2, (0,), ("7", "1"), False),  # past the last GPU: the list stops
        ("0,7,1", None, (0, 7, 1), (), True),
        ("3,1", 4, (3, 1), (), True),
        (f"{U0},{U1}", None, (U0, U1), (), True),
        ("GPU-aaaa", None, ("GPU-aaaa",), (), True),  # prefixes are opaque ids too
        (f"{U0},1", None, (U0,), ("1",), False),
        (f"{U0},{U0}", None, (), (U0, U0), False),
        ("MIG-abc,MIG-def", None, ("MIG-abc", "MIG-def"), (), True),
        ("MIG-abc,GPU-def", None, ("MIG-abc",), ("GPU-def",), False),
    ],
)
def test_parse_visible_devices(value, count, ids, dropped, clean):
    result = parse_visible_devices(value, device_count=count)
    assert result.ids == ids
    assert result.dropped == dropped
    assert result.clean is clean
    assert (result.problem is None) is clean
    assert result.raw == value


@pytest.mark.parametrize(
    ("value", "kind", "env", "deliberate"),
    [
        (None, "all", None, False),
        ("", "none", "", True),
        ("-1", "none", "", True),
        ("0,0", "none", "", False),
        ("2, 0", "ordinal", "2,0", False),
        (U0, "uuid", U0, False),
    ],
)
def test_visible_kind_and_env(value, kind, env, deliberate):
    result = parse_visible_devices(value)
    assert result.kind == kind
    assert result.as_env() == env
    assert result.deliberately_hides_all is deliberate


def test_problem_says_what_is_exposed():
    result = parse_visible_devices("0,,1")
    assert result.problem is not None and "exposes 0" in result.problem
    assert "twice" in (parse_visible_devices("0,0").problem or "")
    assert "NVIDIA_VISIBLE_DEVICES" in (parse_visible_devices("all").problem or "")


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("1,2", "1,2"),
        (" 1 , 2 ", "1,2"),
        ([0, 3], "0,3"),
        (("1",), "1"),
        ("", ""),
        ([], ""),
        ("007", "7"),
        ([U0, U1], f"{U0},{U1}"),
        ("MIG-abc", "MIG-abc"),
    ],
)
def test_validate_accepts(given, expected):
    assert validate_visible_devices(given) == expected


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("0,,1", "''"),
        ("0 1", "'0 1'"),
        ("-1", "'-1'"),
        ("0,0", "twice"),
        ([1, 1], "twice"),
        ("all", "'all'"),
        ("GPU-", "'GPU-'"),
        (f"0,{U0}", "mixed"),
        ([True], "True"),
        ([1.5], "1.5"),
    ],
)
def test_validate_refuses(given, message):
    with pytest.raises(ValueError, match=None) as info:
        validate_visible_devices(given)
    assert message in str(info.value)


A100 = dict(compute_capability=(8, 0), total_bytes=80 << 30)
T4 = dict(compute_capability=(7, 5), total_bytes=16 << 30)


def _gpus(*specs):
    # NVML index i sits on bus 0000:0i:00.0 unless the spec says otherwise
    return [
        PhysicalGpu(nvml_index=i, uuid=f"GPU-{i}{i}{i}{i}", pci_bus_id=f"00000000:0{i}:00.0", **s)
        for i, s in enumerate(specs)
    ]


@pytest.mark.parametrize(
    ("specs", "order", "expected"),
    [
        ((A100, A100, A100), None, [0, 1, 2]),  # identical GPUs: PCI order either way
        ((A100, A100, A100), "PCI_BUS_ID", [0, 1, 2]),
        ((T4, A100, T4), "PCI_BUS_ID", [0, 1, 2]),
        ((T4, A100, T4), None, [1, 0, 2]),  # fastest first: newer capability leads
        ((T4, A100, T4), "FASTEST_FIRST", [1, 0, 2]),
        ((T4, A100, T4), " pci_bus_id ", [0, 1, 2]),
        ((T4, dict(compute_capability=(7, 5), total_bytes=32 << 30)), None, [1, 0]),
        ((T4, {}), None, [0, 1]),  # unknown capability sorts last
    ],
)
def test_cuda_enumeration(specs, order, expected):
    assert cuda_enumeration(_gpus(*specs), order) == expected


def test_cuda_enumeration_sorts_by_bus_not_nvml_index():
    gpus = [
        PhysicalGpu(nvml_index=0, pci_bus_id="00000000:81:00.0"),
        PhysicalGpu(nvml_index=1, pci_bus_id="00000000:01:00.0"),
    ]
    assert cuda_enumeration(gpus, "PCI_BUS_ID") == [1, 0]


def _targets(value, specs, order=None, count=None, mig=()):
    gpus = _gpus(*specs)
    if mig:
        gpus[0] = PhysicalGpu(**{**gpus[0].__dict__, "mig_uuids": tuple(mig)})
    visible = parse_visible_devices(value, device_count=count)
    return [
        (t.torch_index, t.nvml_index, t.cuda_ordinal, t.mig_uuid)
        for t in map_visible(visible, gpus, order)
    ]


@pytest.mark.parametrize(
    ("value", "specs", "order", "expected"),
    [
        (None, (A100, A100), None, [(0, 0, 0, None), (1, 1, 1, None)]),
        ("1", (A100, A100), None, [(0, 1, 1, None)]),
        ("2,0", (A100, A100, A100), None, [(0, 2, 2, None), (1, 0, 0, None)]),
        # FASTEST_FIRST on mixed GPUs: ordinal 0 is the A100 at NVML index 1
        ("0", (T4, A100), None, [(0, 1, 0, None)]),
        ("0", (T4, A100), "PCI_BUS_ID", [(0, 0, 0, None)]),
        ("0,5,1", (A100, A100), None, [(0, 0, 0, None)]),
        ("", (A100,), None, []),
        ("GPU-1111,GPU-0000", (A100, A100), None, [(0, 1, 1, None), (1, 0, 0, None)]),
        ("GPU-11", (A100, A100), None, [(0, 1, 1, None)]),  # unique prefix
        ("GPU-9999,GPU-0000", (A100, A100), None, []),  # unknown UUID ends the list
        ("GPU-0000,GPU-00", (A100, A100), None, []),  # same GPU twice hides all
    ],
)
def test_map_visible(value, specs, order, expected):
    assert _targets(value, specs, order) == expected


def test_map_visible_ambiguous_prefix_stops():
    gpus = [PhysicalGpu(0, uuid="GPU-ab1"), PhysicalGpu(1, uuid="GPU-ab2")]
    assert map_visible(parse_visible_devices("GPU-ab"), gpus, None) == []


def test_map_visible_mig_instance():
    got = _targets("MIG-x1", (A100, A100), mig=("MIG-x1", "MIG-x2"))
    assert got == [(0, 0, 0, "MIG-x1")]
