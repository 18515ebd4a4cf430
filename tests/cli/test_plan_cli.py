"""`torchgpu plan`: table, chosen plan and command, --json schema, exit codes."""

from __future__ import annotations

import json

import pytest
import torch

from torchgpu.cli.main import main
from torchgpu.cli.plan import EXAMPLE_INPUT_SHAPES
from torchgpu.data import example_data
from torchgpu.models import build_model


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_schema_for_a_hypothetical_machine(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys, "--example", "lenet", "--batch-size", "64", "--devices", "2x16GiB", "--json"
    )
    assert code == 0, err
    doc = json.loads(out)
    assert doc["schema"] == 1
    assert doc["workload"] == {
        "example": "lenet",
        "model": None,
        "batch_size": 64,
        "optimizer": "adam",
        "precision": "fp32",
    }
    assert [d["name"] for d in doc["devices"]] == ["gpu0", "gpu1"]
    assert doc["devices"][0]["memory_bytes"] == 16 * 1024**3 and doc["devices"][0]["real"] is False
    assert doc["headroom_fraction"] == pytest.approx(0.1)
    labels = [s["label"] for s in doc["strategies"]]
    assert {"single", "ddp", "fsdp", "pipeline", "model (split)", "single + checkpointing"} <= set(
        labels
    )
    # LeNet's fp32 parameters; Adam keeps two state tensors per parameter
    params = sum(p.numel() for p in build_model("lenet").parameters())
    assert 4 * params <= doc["footprint"]["param_bytes"] <= 4 * params * 1.02  # 512-byte blocks
    assert doc["footprint"]["optimizer_bytes"] == 2 * doc["footprint"]["grad_bytes"]
    assert doc["footprint"]["batch_size"] == 64
    plan = doc["plan"]
    assert plan["strategy"] == "single"  # LeNet is small: one device
    assert plan["command"] == "torchgpu train --example lenet --strategy single --batch-size 64"
    assert doc["error"] is None
    for row in doc["strategies"]:
        assert len(row["per_device_bytes"]) == len(row["devices"]) == len(row["usable_bytes"])


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--example", "housing", "--devices", "1x1GiB")
    assert code == 0
    assert "single + checkpointing" in out
    assert "plan:" in out and "run:" in out
    assert "torchgpu train --example housing --strategy single --batch-size 16" in out


def test_bad_devices_exit_2_with_message(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "--devices", "4xlots")
    assert code == 2
    assert "'4xlots'" in err and "4x80GiB" in err
    assert "Traceback" not in err and out == ""


def test_nothing_fits_prints_table_and_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "--example", "resnet50", "--devices", "1x200MiB", "--json")
    assert code == 1
    doc = json.loads(out)
    assert doc["plan"] is None and "no strategy fits" in doc["error"]
    assert not any(row["fits"] for row in doc["strategies"])
    assert "no strategy fits" in err and "usable" in err


def test_custom_model(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys,
        "--model",
        "tests.cli.plan_models:mlp",
        "--input-shape",
        "4,32",
        "--devices",
        "1x4GiB",
        "--json",
    )
    assert code == 0, err
    doc = json.loads(out)
    assert doc["workload"]["batch_size"] == 4
    assert doc["footprint"]["layers"] == 5
    assert doc["plan"]["command"] is None  # torchgpu train has no --model


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--model", "tests.cli.plan_models:mlp"], "needs --input-shape"),
        (["--input-shape", "2,3"], "--input-shape goes with --model"),
        (["--model", "tests.cli.plan_models:mlp", "--input-shape", "2,x"], "'2,x'"),
        (
            ["--model", "tests.cli.plan_models:not_a_model", "--input-shape", "2,3"],
            "not an nn.Module",
        ),
        (["--model", "no_such_module_xyz:f", "--input-shape", "2,3"], "no_such_module_xyz"),
        (["--batch-size", "0"], "--batch-size 0"),
        (["--optimizer", "lion", "--devices", "1x1GiB"], "'lion'"),
    ],
)
def test_usage_errors_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert needle in err
    assert out == "" and "Traceback" not in err


def test_unknown_example_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan", "--example", "alexnet"])
    assert info.value.code == 2
    assert "alexnet" in capsys.readouterr().err


def test_example_shapes_match_the_data() -> None:
    for name, shape in EXAMPLE_INPUT_SHAPES.items():
        assert example_data(name, size=8).input_shape == shape


def test_plan_never_initialises_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    run(capsys, "--example", "housing", "--devices", "2x8GiB", "--json")
    assert not torch.cuda.is_initialized()
