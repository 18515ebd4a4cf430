"""``--compile`` / ``fit(compile=True)``: a compiled run trains, keeps canonical keys,
resumes bitwise and records what it did; where torch.compile cannot compile, the run
says why in one line and continues eager; bad compile flags are refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import TensorDataset

from tests.step_limit import train_until
from torchgpu import fit
from torchgpu.cli.main import main
from torchgpu.train.config import TrainConfig
from torchgpu.train.task import user_task


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).squeeze(-1)


def _make() -> _Net:
    torch.manual_seed(0)  # the same weights in fit and in train (which does not seed)
    return _Net()


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, generator=g))


_SETTINGS: dict[str, Any] = {"epochs": 2, "batch_size": 8, "seed": 1, "progress": "off",
                             "save_every": 2, "activation_checkpointing": True}


@pytest.mark.slow
def test_compiled_run_resumes_bitwise_and_keeps_canonical_keys(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._inductor.compile_fx as compile_fx

    compiled: list[int] = []
    real = compile_fx.compile_fx

    def counted(*args: Any, **kwargs: Any) -> Any:
        compiled.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(compile_fx, "compile_fx", counted)
    torch._dynamo.reset()
    loss = nn.functional.mse_loss
    whole = fit(_make, _data(), loss=loss, compile=True, out=tmp_path / "whole", **_SETTINGS)
    assert whole.summary["compile"] == {"mode": "default", "compiled": True, "fallback": None}
    assert whole.summary["activation_checkpointing"] is True
    assert compiled  # inductor compiled the model (checkpointed blocks included)
    written = (tmp_path / "whole" / "config.toml").read_text().splitlines()
    assert "compile = true" in written
    # The same compiled run stopped after step 3, then resumed compiled in a new call.
    task = user_task(_make, _data(), loss=loss, name="_make")
    config = TrainConfig(model="fit:_make", data="fit:TensorDataset", compile=True,
                         out=str(tmp_path / "cut"), **_SETTINGS)
    assert train_until(3, config, task=task).summary["stopped_early"]
    resumed = fit(_make, _data(), loss=loss, compile=True, out=tmp_path / "cut", resume=True,
                  **_SETTINGS)
    assert resumed.summary["steps"] == whole.summary["steps"] == 8
    for (name, a), b in zip(whole.model.state_dict().items(),
                            resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    # Canonical keys everywhere: the final weights and every checkpoint's model.
    plain = set(_Net().state_dict())
    assert set(load_file(tmp_path / "whole" / "model.safetensors")) == plain
    checkpoints = sorted((tmp_path / "whole" / "checkpoints").glob("step-*"))
    assert checkpoints
    for ckpt in checkpoints:
        weights = [f for f in ckpt.iterdir() if f.suffix == ".safetensors"]
        assert weights and all(set(load_file(f)) == plain for f in weights), ckpt
    # An eager run of the same settings computes the same losses (within float error).
    eager = fit(_make, _data(), loss=loss, out=tmp_path / "eager", **_SETTINGS)
    assert eager.summary["final"]["train_loss"] == pytest.approx(
        whole.summary["final"]["train_loss"], rel=1e-5)
    # An eager run's checkpoint resumes compiled (the same keys).
    config = TrainConfig(model="fit:_make", data="fit:TensorDataset",
                         out=str(tmp_path / "cut_eager"), **_SETTINGS)
    train_until(3, config, task=task)
    mixed = fit(_make, _data(), loss=loss, compile=True, out=tmp_path / "cut_eager",
                resume=True, **_SETTINGS)
    assert mixed.summary["steps"] == 8 and mixed.summary["compile"]["compiled"]
    for (name, a), b in zip(whole.model.state_dict().items(),
                            mixed.model.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_no_compiler_falls_back_to_eager_saying_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import torch._inductor.compile_fx as compile_fx

    def no_compiler(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("Failed to find a working C++ compiler (simulated)")

    # inductor, dynamo's default backend, fails as on a machine without a C compiler
    monkeypatch.setattr(compile_fx, "compile_fx", no_compiler)
    torch._dynamo.reset()
    settings = {**_SETTINGS, "save_every": None}
    fell = fit(_make, _data(), loss=nn.functional.mse_loss, compile=True,
               out=tmp_path / "fell", **settings)
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if "could not compile" in line]
    assert len(notes) == 1, err
    assert "continues eager" in notes[0] and "C/C++ compiler" in notes[0]
    assert "Failed to find a working C++ compiler" in notes[0]  # why, in the same line
    state = fell.summary["compile"]
    assert state["compiled"] is False and state["fallback"]
    eager = fit(_make, _data(), loss=nn.functional.mse_loss, out=tmp_path / "eager",
                **settings)
    # the step that failed to compile ran eagerly once: nothing lost, nothing doubled
    assert fell.summary["steps"] == eager.summary["steps"]
    for (name, a), b in zip(eager.model.state_dict().items(),
                            fell.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    torch._dynamo.reset()


@pytest.mark.parametrize(("flags", "match"), [
    (["--compile-mode", "max-autotune"], "without --compile"),
    (["--compile", "--compile-mode", "fastest"], "unknown compile_mode 'fastest'"),
    (["--compile", "--strategy", "model", "--devices", "cpu,cpu"],
     "--compile is not supported by --strategy model"),
])
def test_bad_compile_flags_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  flags: list[str], match: str) -> None:
    code = main(["train", "--example", "housing", "--data-size", "32", "--epochs", "1",
                 "--out", str(tmp_path / "r"), *flags])
    err = capsys.readouterr().err
    assert code == 2 and match in err and "Traceback" not in err, err
    assert not (tmp_path / "r").exists()


def test_fit_takes_compile_by_the_flags_names(tmp_path: Path) -> None:
    from torchgpu.errors import UsageError

    with pytest.raises(UsageError, match="compile takes True or False"):
        fit(_make, _data(), loss=nn.functional.mse_loss, compile="max-autotune",
            out=tmp_path / "r")
    summary_keys = json.dumps(TrainConfig(compile=True, compile_mode="max-autotune").__dict__)
    assert '"compile_mode": "max-autotune"' in summary_keys


class _Fails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("the model's own bug")


def test_guard_falls_back_once_and_leaves_the_models_own_errors_alone(
        capsys: pytest.CaptureFixture[str]) -> None:
    from torchgpu.train.recipe.compiling import CompileGuard, CompileState

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("backend broke\nmore detail")

    model, x = nn.Linear(2, 2), torch.ones(1, 2)
    state = CompileState("default")
    model._compiled_call_impl = CompileGuard(model, broken, state)
    assert torch.equal(model(x), nn.functional.linear(x, model.weight, model.bias))
    assert state.as_dict() == {"mode": "default", "compiled": False,
                               "fallback": "RuntimeError: backend broke"}
    assert model._compiled_call_impl is None  # eager from now on
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    # A forward that fails eagerly too is the model's error: raised, compile kept.
    bad, bad_state = _Fails(), CompileState("default")
    guard = CompileGuard(bad, broken, bad_state)
    bad._compiled_call_impl = guard
    with pytest.raises(ValueError, match="own bug"):
        bad(x)
    assert bad._compiled_call_impl is guard and bad_state.compiled
    # Once a compiled call succeeded, only compile errors fall back.
    guard.succeeded = True
    with pytest.raises(RuntimeError, match="backend broke"):
        bad(x)


def test_flags_reach_the_workers() -> None:
    from torchgpu.cli.train import worker_argv
    from torchgpu.cli.train_flags import config_from_argv

    config = TrainConfig(activation_checkpointing="ConvUnit", compile=True,
                         compile_mode="max-autotune", out="r")
    again = config_from_argv(worker_argv(config))
    assert again.activation_checkpointing == "ConvUnit"
    assert again.compile and again.compile_mode == "max-autotune"
    assert config_from_argv(["--activation-checkpointing"]).activation_checkpointing is True
    assert config_from_argv([]).activation_checkpointing is False
