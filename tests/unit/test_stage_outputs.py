"""The multi-process pipeline refuses a stage output torch's stages cannot pass on (a dict,
a tuple holding a string, None from the last stage), naming the stage's last layer and
the type on the rank that ran it -- left to torch, one rank failed in its shape
inference with an internal error and the other lost its peer."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.procs import run_cli
from torchgpu.errors import MicroBatchTypeError
from torchgpu.parallel.stage_forward import StageForward, check_stage_output


class ToDict(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"h": x}


STAGE = nn.Sequential(nn.Linear(2, 2), ToDict())


@pytest.mark.parametrize(("out", "last", "words"), [
    ({"h": torch.ones(1)}, False, "stage 3 (its last layer ToDict) returned dict"),
    ((torch.ones(1), "s"), False, "returned tuple"),
    (None, True, "the last stage (its last layer ToDict) returned NoneType"),
    ("text", True, "returned str"),
])
def test_outputs_that_cannot_pass_are_refused(out: object, last: bool, words: str) -> None:
    with pytest.raises(MicroBatchTypeError, match=words.replace("(", r"\(").replace(")", r"\)")):
        check_stage_output(out, STAGE, 3, last)


@pytest.mark.parametrize(("out", "last"), [
    (torch.ones(2), False), ((torch.ones(2), torch.ones(3)), False),
    (torch.ones(2), True), ({"logits": torch.ones(2)}, True),  # the loss reads the last
])
def test_tensors_pass(out: object, last: bool) -> None:
    check_stage_output(out, STAGE, 0, last)


def test_the_check_runs_once_per_stage() -> None:
    calls = []

    class Spy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            return x

    run = StageForward(Spy(), None, None, index=0, last=False)
    run(torch.ones(2))
    run(torch.ones(2))
    assert run._checked and len(calls) == 2


@pytest.mark.slow
def test_train_names_the_stage_instead_of_an_internal_error(tmp_path: Path) -> None:
    spec = tmp_path / "dict_stage.py"
    spec.write_text(textwrap.dedent("""
        import torch
        from torch import nn
        from torch.utils.data import TensorDataset

        class ToDict(nn.Module):
            def forward(self, x):
                return {"h": x}

        class FromDict(nn.Module):
            def forward(self, d):
                return d["h"]

        def model():
            return nn.Sequential(nn.Linear(4, 4), ToDict(), FromDict(), nn.Linear(4, 1))

        def data():
            g = torch.Generator().manual_seed(0)
            x, y = torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)
            return TensorDataset(x[:24], y[:24]), TensorDataset(x[24:], y[24:])
    """))
    out = tmp_path / "run"
    done = run_cli(["train", "--model", f"{spec}:model", "--data", f"{spec}:data", "--loss",
                    "mse", "--strategy", "pipeline", "--nproc", "2", "--balance", "2,2",
                    "--epochs", "1", "--batch-size", "8", "--out", str(out),
                    "--progress", "off"], timeout=180)
    assert done.returncode != 0
    assert "stage 0 (its last layer ToDict) returned dict" in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
