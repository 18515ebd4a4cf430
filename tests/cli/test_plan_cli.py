"""`torchgpu plan`: table, chosen plan and command, --json schema, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

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
    assert doc["plan"]["command"] is None  # a custom model gets Python, not a command line
    python = doc["plan"]["python"]  # ... so the plan comes as torchgpu calls
    assert python.splitlines()[0] == "from tests.cli.plan_models import mlp"
    assert "model = mlp().to('cuda:0')" in python
    compile(python, "<plan>", "exec")
    assert doc["plan"]["train_settings"] == {
        "strategy": "single",
        "batch_size": 4,
        "accumulate": 1,
        "activation_checkpointing": False,
    }


def test_table_prints_the_pipeline_command_with_its_cut(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(
        capsys,
        "--example",
        "resnet50",
        "--batch-size",
        "64",
        "--devices",
        "1x1GiB,1x400MiB",
        "--json",
    )
    assert code == 0, err
    plan = json.loads(out)["plan"]
    assert plan["strategy"] == "pipeline" and plan["balance"] == [4, 2]  # by capacity
    assert "of 360.0 MiB usable on gpu1" in plan["reason"]
    command = plan["command"]
    assert f"--balance {','.join(map(str, plan['balance']))}" in command
    assert ("--activation-checkpointing" in command) == plan["activation_checkpointing"]
    assert "--devices cuda:0,cuda:1" in command


_FACTORIES = """
import torch
from torch import nn


class SeedSplit(nn.Module):  # seed 002 style: places its own layers on two GPUs
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16).to("cuda:0")
        self.b = nn.Linear(16, 2, device="cuda:1")

    def forward(self, x):
        return self.b(self.a(x.to("cuda:0")).cuda(1))


def seed_split():
    return SeedSplit()


def raises():
    raise ValueError("bad arg")


def runtime():
    torch.cuda.current_device()  # needs a GPU even where one exists
    return nn.Linear(8, 2)
"""


@pytest.fixture()
def factories(tmp_path: Path) -> str:
    path = tmp_path / "factories.py"
    path.write_text(_FACTORIES)
    return str(path)


def test_a_model_that_places_itself_on_gpus_is_planned(
    capsys: pytest.CaptureFixture[str], factories: str
) -> None:
    code, out, err = run(
        capsys, "--model", f"{factories}:seed_split", "--input-shape", "4,8", "--devices", "2x1GiB"
    )
    assert code == 0, err
    assert "Traceback" not in err
    # measured as one model: 8*16+16 + 16*2+2 = 178 fp32 parameters
    assert "run:" in out and "torchgpu's Python API" in out
    assert f"seed_split = runpy.run_path({factories!r})['seed_split']" in out
    assert not torch.cuda.is_initialized()
    code, out, err = run(
        capsys,
        "--model",
        f"{factories}:seed_split",
        "--input-shape",
        "4,8",
        "--devices",
        "2x1GiB",
        "--json",
    )
    params = json.loads(out)["footprint"]["param_bytes"]
    assert 178 * 4 <= params <= 178 * 4 + 2 * 4 * 512  # 512-byte blocks per tensor


@pytest.mark.parametrize(
    ("factory", "shape", "needles"),
    [
        ("raises", "2,8", ["raises() failed: ValueError: bad arg", "Fix the factory"]),
        ("seed_split", "2,9", ["failed in a: RuntimeError", "Check --input-shape", "2,9"]),
    ],
)
def test_failing_factory_or_forward_is_exit_2_in_one_paragraph(
    capfd: pytest.CaptureFixture[str],
    factories: str,
    factory: str,
    shape: str,
    needles: list[str],
) -> None:
    code = main(
        ["plan", "--model", f"{factories}:{factory}", "--input-shape", shape, "--devices", "2x1GiB"]
    )
    out, err = capfd.readouterr()
    assert code == 2 and out == ""
    assert "Traceback" not in err and "fake_tensor" not in err
    assert len(err.strip().splitlines()) == 1
    for needle in needles:
        assert needle in err


def test_cuda_runtime_calls_are_named(capsys: pytest.CaptureFixture[str], factories: str) -> None:
    if torch.version.cuda is not None:  # a GPU machine, or a CUDA build without a driver
        pytest.skip("checks what a CPU-only build of torch says to the factory's torch.cuda "
                    "call; a CUDA build answers otherwise (or succeeds)")
    code, out, err = run(
        capsys, "--model", f"{factories}:runtime", "--input-shape", "2,8", "--devices", "1x1GiB"
    )
    assert code == 2 and out == "" and "runtime() failed" in err and "torch.cuda" in err
    assert "Traceback" not in err


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


# ------------------------------------------------- users' models: --data, token inputs
def test_model_with_data_plans_from_a_collated_batch(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys, "--model", "tests.user_models:lm_factory", "--data", "tests.user_models:lm_data",
        "--batch-size", "8", "--devices", "2x1GiB", "--json",
    )
    assert code == 0, err
    doc = json.loads(out)
    assert doc["workload"]["batch_size"] == 8
    rows = {s["label"]: s for s in doc["strategies"]}
    # the causal LM is not sequential: no split rows; its blocks can be checkpointed
    assert not rows["model"]["applicable"] and not rows["pipeline"]["applicable"]
    assert rows["single + checkpointing"]["applicable"]
    fp = doc["footprint"]
    assert 0 < fp["checkpointed_activation_bytes"] < fp["activation_bytes"]


def test_token_inputs_from_a_shape_with_a_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--model", "tests.user_models:lm_factory", "--devices", "1x1GiB", "--json"]
    code, out, err = run(capsys, *args, "--input-shape", "4,12:int64")
    assert code == 0, err
    assert json.loads(out)["workload"]["batch_size"] == 4
    # float inputs make the embedding fail: one paragraph that says how to give token ids
    code, out, err = run(capsys, *args, "--input-shape", "4,12")
    assert code == 2 and out == "" and "Traceback" not in err
    assert "failed in embed" in err and ":int64 for token ids" in err


def test_data_of_pairs_feeds_the_inputs(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys, "--model", "tests.user_models:cnn_factory", "--data", "tests.user_models:cnn_data",
        "--devices", "1x1GiB", "--json",
    )
    assert code == 0, err
    assert json.loads(out)["workload"]["batch_size"] == 16  # train's default for --model


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--data", "tests.user_models:lm_data"], ["--data goes with --model"]),
        (["--model", "tests.user_models:lm_factory", "--data", "tests.user_models:lm_data",
          "--input-shape", "2,12"], ["give one of them"]),
        (["--model", "tests.user_models:lm_factory", "--data", "tests.user_models:not_a_dataset"],
         ["not_a_dataset() returned a model (Linear), not a Dataset", "--model"]),
        (["--model", "tests.user_models:lm_factory", "--data", "tests.user_models:nope"],
         ["has no attribute 'nope'"]),
        (["--model", "tests.user_models:lm_factory", "--data", "tests.user_models:cnn_data"],
         ["the forward on a batch of shape 16,3,8,8 failed in embed", "Check that --data"]),
        (["--model", "tests.user_models:lm_factory", "--input-shape", "2,12:complex"],
         ["dtype 'complex' is not known", "2,128:int64"]),
        (["--model", "tests.user_models:lm_factory"], ["needs --input-shape", "--data SPEC"]),
    ],
)
def test_bad_data_specs_exit_2_in_one_paragraph(
    capsys: pytest.CaptureFixture[str], argv: list[str], needles: list[str]
) -> None:
    code, out, err = run(capsys, *argv, "--devices", "1x1GiB")
    assert code == 2 and out == "" and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    for needle in needles:
        assert needle in err


def test_plan_with_model_and_data_specs_prints_a_train_command_that_validates() -> None:
    import shlex

    from tests.procs import REPO, run_cli
    from torchgpu.cli.train_flags import config_from_argv
    from torchgpu.train.config_checks import validate

    done = run_cli(["plan", "--model", "tests.user_models:lm_factory", "--data",
                    "tests.user_models:lm_data", "--batch-size", "32", "--devices", "1x1GiB"],
                   timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("run:"))
    argv = shlex.split(line.removeprefix("run:").strip())
    assert argv[:2] == ["torchgpu", "train"]
    assert argv[argv.index("--model") + 1] == "tests.user_models:lm_factory"
    assert argv[argv.index("--data") + 1] == "tests.user_models:lm_data"
    validate(config_from_argv(argv[2:]))
