"""Activation checkpointing computes what the plain model computes when a segment or a
block starts with an in-place layer (ReLU(inplace=True), x.mul_(), Dropout(inplace)),
with or without input gradients, also from `torchgpu train --activation-checkpointing`;
and nothing is recomputed in eval mode."""

from __future__ import annotations

import copy
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from torchgpu.cli.main import main
from torchgpu.memory.activation_checkpointing import apply_activation_checkpointing


class MulInPlace(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2.0)


FIRST = {
    "relu": lambda: nn.ReLU(inplace=True),
    "mul_": MulInPlace,
    "leaky": lambda: nn.LeakyReLU(0.1, inplace=True),
    "dropout": lambda: nn.Dropout(0.3, inplace=True),
}


def _mlp(first: str, layers: int = 5) -> nn.Sequential:
    """Linear, then the in-place layer: every segment boundary lands on one of them
    whatever the count (even positions are the in-place layers)."""
    torch.manual_seed(0)
    modules: list[nn.Module] = [nn.Linear(8, 8)]
    for _ in range(layers):
        modules += [FIRST[first](), nn.Linear(8, 8)]
    return nn.Sequential(*modules)


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output and gradients (parameters, and the input's when it requires grad; such an
    input reaches the model as a non-leaf, as an activation would)."""
    model.zero_grad(set_to_none=True)
    leaf = x.detach().clone().requires_grad_(x.requires_grad)
    torch.manual_seed(5)  # the same dropout masks
    out = model(leaf * 1.0 if leaf.requires_grad else leaf)
    out.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    return out.detach(), grads + ([leaf.grad.clone()] if leaf.grad is not None else [])


@pytest.mark.parametrize("first", list(FIRST))
@pytest.mark.parametrize("segments", [2, 3, 4, 11])
@pytest.mark.parametrize("input_grad", [False, True])
def test_segments_starting_in_place_match_the_plain_model(
    first: str, segments: int, input_grad: bool
) -> None:
    plain = _mlp(first)
    ckpt = apply_activation_checkpointing(copy.deepcopy(plain), segments)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).requires_grad_(input_grad)
    plain.insert(0, FIRST[first]())  # an in-place layer first of all, on the input too
    ckpt.insert(0, FIRST[first]())
    want_out, want = _step(plain, x)
    got_out, got = _step(ckpt, x)
    assert torch.equal(want_out, got_out)
    assert len(want) == len(got) and all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


class Block(nn.Module):
    """A residual block whose forward changes its input in place first."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.relu_()
        return x + self.norm(self.lin(x))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x * 1.0)
        return x


def test_blocks_changing_their_input_in_place_match_the_plain_model() -> None:
    plain = Stack()
    ckpt = apply_activation_checkpointing(copy.deepcopy(plain))  # finds the repeated Block
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(2), requires_grad=True)
    want_out, want = _step(plain, x)
    got_out, got = _step(ckpt, x)
    assert torch.equal(want_out, got_out)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    # BatchNorm counted each batch once (the recompute left the statistics alone)
    for a, b in zip(plain.modules(), ckpt.modules(), strict=True):
        if isinstance(a, nn.BatchNorm1d):
            assert isinstance(b, nn.BatchNorm1d)
            assert int(b.num_batches_tracked) == int(a.num_batches_tracked) == 1
            assert torch.equal(a.running_mean, b.running_mean)


class Counter(nn.Module):
    """Counts its forward calls (a recompute calls it again)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x)


class Counters(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Counter() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("mode", ["segments", "blocks"])
def test_nothing_is_recomputed_in_eval_mode(mode: str) -> None:
    if mode == "segments":
        model: nn.Module = nn.Sequential(*(Counter() for _ in range(4)))
        apply_activation_checkpointing(model, 4)
        checkpointed = list(model)[:3]  # all but the last segment
    else:
        model = Counters()
        apply_activation_checkpointing(model, blocks=Counter)
        checkpointed = list(model.blocks)
    x = torch.randn(2, 8, requires_grad=True)

    def calls(training: bool) -> list[int]:
        for c in checkpointed:
            c.calls = 0
        model.train(training)
        model(x).sum().backward()
        return [c.calls for c in checkpointed]  # type: ignore[misc]

    assert calls(False) == [1] * len(checkpointed)  # eval mode, grad enabled: run plainly
    assert calls(True) == [2] * len(checkpointed)  # training: forward + recompute
    with torch.no_grad():
        model.train()
        for c in checkpointed:
            c.calls = 0
        model(x)
        assert [c.calls for c in checkpointed] == [1] * len(checkpointed)


_SPEC = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

def make():
    layers = [nn.Linear(13, 16)]
    for _ in range(4):
        layers += [nn.ReLU(inplace=True), nn.Linear(16, 16)]
    return nn.Sequential(*layers, nn.Linear(16, 1))

def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 13, generator=g)
    y = x.sum(1, keepdim=True)
    return TensorDataset(x[:48], y[:48]), TensorDataset(x[48:], y[48:])
"""


def test_train_activation_checkpointing_with_in_place_layers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "inplace_model.py"
    spec.write_text(textwrap.dedent(_SPEC))
    args = ["train", "--model", f"{spec}:make", "--data", f"{spec}:data", "--loss", "mse",
            "--epochs", "1", "--batch-size", "16", "--device", "cpu"]
    code = main([*args, "--activation-checkpointing", "--out", str(tmp_path / "ac")])
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err, err
    assert main([*args, "--out", str(tmp_path / "plain")]) == 0
    from safetensors.torch import load_file

    with_ac = load_file(tmp_path / "ac" / "model.safetensors")
    without = load_file(tmp_path / "plain" / "model.safetensors")
    assert with_ac.keys() == without.keys()
    assert all(torch.equal(with_ac[k], without[k]) for k in with_ac)
