"""--memory-snapshot and OOM snapshots: refused on CPU with the reason; live allocations
grouped by the module whose forward made them; the recorder's CUDA calls (mocked here,
real in the gpu test) write a pickle and an HTML page and name them in the OOM message;
the summary puts an estimate next to the measured peak."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from torchgpu.errors import ConfigError
from torchgpu.train.config import TrainConfig
from torchgpu.train.observe import memory_snapshot as ms
from torchgpu.train.observe.memory_report import NOT_ASKED, annotate_devices, memory_estimate
from torchgpu.train.runner import train


class Scaler(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        doubled = x * 2  # the frame the test's allocation points at
        return doubled


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = Scaler()
        self.fc = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.scale(x))


SCALER_LINE = Scaler.forward.__code__.co_firstlineno + 1
OPTIM = "/venv/lib/python3.11/site-packages/torch/optim/adam.py"


def _snapshot() -> dict[str, Any]:
    def block(size: int, frames: list[dict[str, Any]], state: str = "active_allocated"
              ) -> dict[str, Any]:
        return {"size": size, "requested_size": size, "state": state, "frames": frames}

    here = {"filename": __file__, "line": SCALER_LINE, "name": "forward"}
    return {"segments": [
        {"total_size": 8192, "blocks": [
            block(1000, [here, {"filename": "/x/torch/nn/modules/module.py", "line": 1,
                                "name": "_call_impl"}]),
            block(500, [here]),
            block(3000, [{"filename": OPTIM, "line": 9, "name": "_init_group"}]),
            block(9999, [here], state="inactive"),  # cached, not live
        ]},
        {"total_size": 4096, "blocks": [
            block(200, []),
            block(100, [{"filename": "/home/me/train.py", "line": 42, "name": "main"}]),
        ]},
    ], "device_traces": [[]]}


def test_live_allocations_grouped_by_module() -> None:
    sites = ms.biggest_live(_snapshot(), ms.module_forwards(Net()))
    assert [(s.label, s.bytes, s.blocks) for s in sites] == [
        ("optimizer state", 3000, 1), ("Scaler.forward", 1500, 2),
        ("unknown (no stack recorded)", 200, 1), ("main (train.py:42)", 100, 1)]
    assert ms.live_bytes(_snapshot()) == (4800, 12288)


def test_refused_on_cpu_with_the_reason(tmp_path: Path) -> None:
    ms.refuse_off_cuda(False, torch.device("cpu"))  # not asked: nothing to refuse
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"CUDA caching allocator.*trains on cpu"):
        train(TrainConfig(example="housing", data_size=64, epochs=1, device="cpu",
                          out=str(out), memory_snapshot=True))
    assert not out.exists()


def test_cli_refuses_on_cpu_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from torchgpu.cli.main import main

    assert main(["train", "--memory-snapshot", "--device", "cpu", "--out",
                 str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--memory-snapshot" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_html_page_holds_the_snapshot_and_a_static_summary() -> None:
    sites = ms.biggest_live(_snapshot(), ms.module_forwards(Net()))
    page = ms.render_html(_snapshot(), "CUDA memory <test>", sites)
    assert "CUDA memory &lt;test&gt;" in page and "Scaler.forward" in page
    assert "snapshot.pickle" in page and "base64" in page  # PyTorch's viewer, data inline


class FakeCudaMemory:
    """Stands in for torch.cuda.memory's private snapshot API on a CPU machine."""

    def __init__(self) -> None:
        self.recording: list[Any] = []
        self.options: list[dict[str, Any]] = []

    def _record_memory_history(self, enabled: Any = "all", **kwargs: Any) -> None:
        self.recording.append(enabled)
        self.options.append(kwargs)

    def _snapshot(self) -> dict[str, Any]:
        return _snapshot()


def test_recorder_dumps_on_request_and_on_oom(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeCudaMemory()
    monkeypatch.setattr(torch.cuda, "memory", fake)
    recorder = ms.MemoryRecorder(Net(), tmp_path, rank=0, record=True)
    recorder.arm()
    assert fake.recording == ["all"] and ms._ACTIVE[-1] is recorder
    # Python frames only: C++ symbolisation at dump time can take minutes
    assert fake.options[0] == {"max_entries": ms.MAX_ENTRIES, "stacks": "python"}
    ms._observer(0, 2**30, 3 * 2**30, 2**20)  # what the allocator calls on an OOM
    ms._observer(0, 2**30, 3 * 2**30, 2**20)  # a second OOM in the run: dumped once
    err = capsys.readouterr().err
    oom_pickle, oom_html = tmp_path / "oom_snapshot.pickle", tmp_path / "oom_snapshot.html"
    assert err.count("CUDA out of memory") == 1
    assert str(oom_pickle) in err and str(oom_html) in err and "Scaler.forward" in err
    assert pickle.loads(oom_pickle.read_bytes()) == _snapshot()
    recorder.finish()
    assert fake.recording == ["all", None] and recorder not in ms._ACTIVE
    files = recorder.summary()
    assert files["snapshot"]["html"] == str(tmp_path / "memory_snapshot.html")
    assert (tmp_path / "memory_snapshot.pickle").is_file() and oom_html.is_file()
    assert files["oom"]["biggest_live"][0]["label"] == "optimizer state"
    ms._observer(0, 1, 1, 1)  # after the run: no recorder, nothing written or printed
    assert capsys.readouterr().err == ""


def test_oom_without_history_says_how_to_get_stacks(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeCudaMemory()
    monkeypatch.setattr(torch.cuda, "memory", fake)
    recorder = ms.MemoryRecorder(Net(), tmp_path, rank=1, record=False)
    recorder.arm()
    try:
        ms._observer(1, 10, 20, 30)
    finally:
        recorder.finish()
    assert fake.recording == []  # no history unless asked: it costs per allocation
    assert "rerun with --memory-snapshot" in capsys.readouterr().err
    assert (tmp_path / "oom_snapshot.rank1.html").is_file()


def test_summary_estimate_next_to_the_peak(tmp_path: Path) -> None:
    result = train(TrainConfig(example="housing", data_size=64, epochs=1, device="cpu",
                               out=str(tmp_path), progress="off", estimate_memory=True))
    entry = result.summary["memory_estimate"]
    assert entry["source"] == "estimate_memory" and entry["devices"] == ["cpu"]
    device = result.summary["devices"][0]
    assert device["estimated_peak_bytes"] == entry["per_device_bytes"][0] > 0
    assert device["peak_memory_bytes"] > 0


def test_no_estimate_on_cpu_unless_asked_or_planned() -> None:
    entry = memory_estimate(TrainConfig(), None, task=None, mode="single", world=1)
    assert entry == {"source": None, "note": NOT_ASKED}
    # a CUDA run always estimates (here a missing task makes it fail, which is recorded)
    cuda = memory_estimate(TrainConfig(), None, task=None, mode="single", world=1,
                           device="cuda:0")
    assert cuda["source"] is None and cuda["note"].startswith("estimate_memory failed")
    devices: list[dict[str, Any]] = [{"rank": 0}]
    annotate_devices(devices, entry)
    assert devices == [{"rank": 0}]


def test_planner_row_is_used_when_the_planner_ran() -> None:
    class Row:
        def __init__(self, strategy: str, per_device: tuple[int, ...]) -> None:
            self.strategy, self.label, self.applicable = strategy, strategy, True
            self.micro_batch, self.per_device_bytes = 8, per_device
            self.devices = tuple(f"cuda:{i}" for i in range(len(per_device)))

    class Plan:
        chosen = Row("fsdp", (5, 5))
        candidates = (Row("single", (40,)), Row("ddp", (30, 30)), chosen)

    entry = memory_estimate(TrainConfig(), Plan(), task=None, mode="ddp", world=2)
    assert entry["source"] == "planner" and entry["per_device_bytes"] == [30, 30]
    devices: list[dict[str, Any]] = [{"rank": 0}, {"rank": 1}]
    annotate_devices(devices, entry)
    assert [d["estimated_peak_bytes"] for d in devices] == [30, 30]


@pytest.mark.gpu
def test_real_cuda_snapshot_and_oom(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = train(TrainConfig(example="housing", data_size=64, epochs=1, device="cuda",
                               out=str(tmp_path / "run"), progress="off",
                               memory_snapshot=True))
    files = result.summary["memory_snapshots"]["snapshot"]
    snapshot = pickle.loads(Path(files["pickle"]).read_bytes())
    assert snapshot["device_traces"] and any(snapshot["device_traces"])
    frames = [f for trace in snapshot["device_traces"] for event in trace
              for f in event.get("frames") or ()]
    assert any(str(f.get("filename", "")).endswith(".py") for f in frames)  # Python stacks
    assert "<table" in Path(files["html"]).read_text()
    # every CUDA run checks the estimate against the measured peak
    assert result.summary["memory_estimate"]["source"] == "estimate_memory"
    device = result.summary["devices"][0]
    assert device["estimated_peak_bytes"] > 0 and device["peak_memory_bytes"] > 0
    recorder = ms.MemoryRecorder(Net(), tmp_path / "oom", rank=0, record=True)
    recorder.arm()
    try:
        with pytest.raises(torch.cuda.OutOfMemoryError):
            torch.empty(2**50, dtype=torch.uint8, device="cuda")
    finally:
        recorder.finish()
    assert "oom_snapshot.html" in capsys.readouterr().err
    assert (tmp_path / "oom" / "oom_snapshot.pickle").is_file()
