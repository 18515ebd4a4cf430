"""`torchgpu train` on bad input: exit 2, one paragraph, no traceback, no --out; and the
notes and report a person sees on good input."""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from tests.procs import run_cli
from torchgpu.cli.main import main

BAD_INPUT = [
    (["--example", "mnist"], "mnist"),
    (["--strategy", "zero3"], "zero3"),
    (["--precision", "fp8"], "fp8"),
    (["--device", "cuda:7"], "cuda:7"),
    (["--device", "tpu"], "tpu"),
    (["--nproc", "0"], "--nproc 0"),
    (["--precision", "fp16", "--device", "cpu"], "fp16"),
    (["--strategy", "pipeline"], "pipeline"),
    (["--strategy", "dp", "--nproc", "2"], "dp"),
    (["--epochs", "0"], "--epochs 0"),
    (["--batch-size", "x"], "--batch-size"),
    (["--bogus"], "--bogus"),
    (["--data", "missing.csv", "--target", "y"], "missing.csv"),
    # refused before any worker starts (the CPU named: on a GPU machine fp16 is fine)
    (["--nproc", "2", "--device", "cpu", "--precision", "fp16"], "fp16"),
    (["--lr", "inf"], "--lr inf"),
    (["--lr", "nan"], "--lr nan"),
    (["--lr", "0"], "--lr 0"),
    (["--clip-norm", "inf"], "--clip-norm inf"),
    (["--nnodes", "2", "--rdzv-endpoint", "foo"], "HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:70000"], "HOST:PORT"),
]


def _csv(tmp_path: Path, body: str) -> str:
    path = tmp_path / "table.csv"
    path.write_text(body)
    return str(path)


@pytest.mark.parametrize(("args", "needle"), BAD_INPUT)
def test_bad_input_exits_2_without_writing(
    args: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exited:  # argparse errors exit; ours return
        raise SystemExit(main(["train", *args, "--out", str(out)]))
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert needle in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1  # one paragraph
    assert not out.exists()


@pytest.mark.parametrize("body", [
    "a,b,y\n1,2,3\n4,oops,6\n7,8,9\n",  # non-numeric cell
    "a,b\n1,2\n3,4\n",  # no target column
    "a,b,y\n1,2,nan\n3,4,5\n",  # NaN
    "a,b,y\n1,2,3\n4,5,6\n",  # 1 train row: fewer than one batch (32)
])
def test_bad_csv_exits_2_without_writing(
    body: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    code = main(["train", "--data", _csv(tmp_path, body), "--target", "y", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "table.csv" in err and "Traceback" not in err
    assert not out.exists()


def test_csv_smaller_than_a_batch_is_refused_before_launching(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    rows = "".join(f"{i},{i * 2},{i * 3}\n" for i in range(20))  # 16 train rows
    csv = _csv(tmp_path, "a,b,y\n" + rows)
    code = main(["train", "--data", csv, "--target", "y", "--nproc", "2", "--device", "cpu",
                 "--batch-size", "17", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "fewer than one batch of 17" in err and "--batch-size 16" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def _no_gpu_backend() -> AbstractContextManager[object]:
    from torchgpu.devices import nvml

    return nvml.use_backend(nvml.StaticBackend(nvml.NvmlInventory(error="no driver")))


def test_gpus_naming_a_missing_gpu_names_the_gpus_that_exist(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.nvml_fake import fake_inventory
    from torchgpu.devices import nvml

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # restored afterwards
    out = tmp_path / "out"
    with nvml.use_backend(nvml.StaticBackend(fake_inventory())):  # 3 GPUs
        code = main(["train", "--gpus", "5", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "GPU 5" in err and "has 3 (0..2)" in err
    assert not out.exists()


def test_gpus_without_a_usable_gpu_never_falls_back_to_the_cpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchgpu.devices import cuda_status

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    why = "no NVIDIA driver was found (no NVML, no /proc/driver/nvidia, no nvidia-smi)"
    monkeypatch.setattr(cuda_status, "cuda_unavailable_reason", lambda: why)
    out = tmp_path / "out"
    with _no_gpu_backend():
        code = main(["train", "--gpus", "5", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "--gpus 5" in err and why in err and "--device cpu" in err
    assert "Traceback" not in err and not out.exists()
    # The driver counts fewer GPUs than --gpus names (NVML could not count them).
    monkeypatch.setattr(cuda_status, "cuda_unavailable_reason", lambda: "")
    monkeypatch.setattr(cuda_status, "cuda_device_count", lambda: 1)
    with _no_gpu_backend():
        code = main(["train", "--gpus", "0,5", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "0 exist, 5 does not" in err and not out.exists()


def test_bf16_on_the_cpu_warns_but_trains(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bf16"
    code = main(["train", "--precision", "bf16", "--device", "cpu", "--epochs", "1",
                 "--data-size", "40", "--progress", "off", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 0 and "warning: --precision bf16 on the CPU" in err
    assert json.loads((out / "summary.json").read_text())["precision"] == "bf16"


def test_out_holding_a_run_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    assert main(["train", "--out", str(out), "--epochs", "1"]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"]


def test_dp_without_gpus_falls_back_with_a_note(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "dp"  # --device cpu: no GPU for DataParallel, on any machine
    code = main(["train", "--strategy", "dp", "--device", "cpu", "--epochs", "1",
                 "--data-size", "60", "--progress", "off", "--json", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0
    assert "falling back to one device" in captured.err
    summary = json.loads(captured.out)
    assert summary["strategy"] == "dp" and summary["world_size"] == 1
    assert (out / "model.safetensors").exists()


def test_report_names_plot_metrics_and_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert main(["train", "--epochs", "2", "--data-size", "80", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "epoch 2/2" in text  # one plain line per epoch (stdout is not a TTY)
    for name in ("loss.png", "metrics.jsonl", "model.safetensors"):
        assert str(out / name) in text


@pytest.mark.slow
def test_subprocess_bad_input_has_no_traceback(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = run_cli(["train", "--device", "cuda:7", "--out", str(out)], timeout=60)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "cuda:7" in done.stderr
    assert not out.exists()
