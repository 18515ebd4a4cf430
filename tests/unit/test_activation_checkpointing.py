"""Activation checkpointing: bitwise-equal gradients with dropout, fewer saved bytes,
unchanged state_dict keys; saved_tensor_bytes counting."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from torchgpu.errors import ConfigError
from torchgpu.memory.activation_checkpointing import (
    CheckpointedSequential,
    apply_activation_checkpointing,
    remove_activation_checkpointing,
    segment_bounds,
    sqrt_segments,
)
from torchgpu.memory.saved_tensors import saved_tensor_bytes

WIDTH, BATCH = 64, 32


def _deep_mlp(layers: int = 16) -> nn.Sequential:
    torch.manual_seed(0)
    modules: list[nn.Module] = []
    for _ in range(layers):
        modules += [nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Dropout(0.2)]
    return nn.Sequential(*modules, nn.Linear(WIDTH, 1))


def _grads_after_step(model: nn.Module, x: torch.Tensor, seed: int = 7) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # same dropout masks for both models
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def _x() -> torch.Tensor:
    return torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("segments", ["sqrt", 2, 7])
def test_gradients_are_bitwise_equal_with_dropout(segments: str | int) -> None:
    plain = _deep_mlp()
    ckpt = apply_activation_checkpointing(copy.deepcopy(plain), segments)
    assert isinstance(ckpt, CheckpointedSequential)
    x = _x()
    expected, got = _grads_after_step(plain, x), _grads_after_step(ckpt, x)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    # dropout really was active: another seed gives other gradients
    other = _grads_after_step(plain, x, seed=8)
    assert not all(torch.equal(a, b) for a, b in zip(expected, other, strict=True))


def test_sqrt_segments_save_at_least_half_the_activation_bytes() -> None:
    plain = _deep_mlp()
    ckpt = apply_activation_checkpointing(copy.deepcopy(plain))
    x = _x()
    plain_bytes = saved_tensor_bytes(lambda: plain(x))
    ckpt_bytes = saved_tensor_bytes(lambda: ckpt(x))
    assert plain_bytes > 16 * BATCH * WIDTH * 4  # at least one float activation per layer
    assert ckpt_bytes <= plain_bytes / 2, (ckpt_bytes, plain_bytes)


def test_checkpointing_every_layer_saves_nothing_on_an_mlp() -> None:
    # Why the default is sqrt(n) segments: one segment per Linear keeps each input,
    # which is the previous segment's output anyway.
    torch.manual_seed(0)
    plain = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(8)])
    per_layer = apply_activation_checkpointing(copy.deepcopy(plain), segments=8)
    x = _x()
    assert saved_tensor_bytes(lambda: per_layer(x)) >= saved_tensor_bytes(lambda: plain(x))


def test_state_dict_keys_and_values_are_unchanged() -> None:
    plain = _deep_mlp()
    ckpt = apply_activation_checkpointing(copy.deepcopy(plain))
    assert list(ckpt.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in ckpt.named_parameters()] == [n for n, _ in plain.named_parameters()]
    fresh = apply_activation_checkpointing(_deep_mlp(layers=16))
    for p in fresh.parameters():
        p.data.zero_()
    fresh.load_state_dict(plain.state_dict())  # strict, across the two forms
    pairs = zip(fresh.parameters(), plain.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_checkpointed_sequential_pickles_and_deepcopies() -> None:
    ckpt = apply_activation_checkpointing(_deep_mlp(layers=4))
    buffer = io.BytesIO()
    torch.save(ckpt, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded) is CheckpointedSequential
    clone = copy.deepcopy(ckpt)
    x = _x()
    assert torch.equal(clone.eval()(x), ckpt.eval()(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.relu(self.fc(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block() for _ in range(4)])
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def as_sequential(self) -> nn.Sequential:
        return nn.Sequential(*self.blocks, self.head)


def test_predicate_wraps_matching_modules_only() -> None:
    plain = Net()
    ckpt = apply_activation_checkpointing(copy.deepcopy(plain), lambda _n, m: isinstance(m, Block))
    assert all(type(b).__name__ == "CheckpointedBlock" for b in ckpt.blocks)
    assert isinstance(ckpt.blocks[0], Block) and type(ckpt.head) is nn.Linear
    assert list(ckpt.state_dict()) == list(plain.state_dict())
    x = _x()
    expected, got = _grads_after_step(plain, x), _grads_after_step(ckpt, x)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    assert saved_tensor_bytes(lambda: ckpt(x)) < saved_tensor_bytes(lambda: plain(x))


def test_as_sequential_model_gets_segments() -> None:
    plain = Net()
    ckpt = apply_activation_checkpointing(copy.deepcopy(plain), segments=2)
    assert isinstance(ckpt, Net) and type(ckpt) is not Net
    assert list(ckpt.state_dict()) == list(plain.state_dict())
    x = _x()
    expected, got = _grads_after_step(plain, x), _grads_after_step(ckpt, x)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    assert saved_tensor_bytes(lambda: ckpt(x)) < saved_tensor_bytes(lambda: plain(x))


def test_remove_restores_the_original_classes() -> None:
    seq = apply_activation_checkpointing(_deep_mlp(layers=2))
    assert type(remove_activation_checkpointing(seq)) is nn.Sequential
    net = apply_activation_checkpointing(Net(), lambda _n, m: isinstance(m, Block))
    remove_activation_checkpointing(net)
    assert all(type(b) is Block for b in net.blocks)
    # applying twice does not stack wrappers
    twice = apply_activation_checkpointing(apply_activation_checkpointing(_deep_mlp(2), 2), 3)
    assert type(twice) is CheckpointedSequential
    assert twice._torchgpu_ckpt_segments == 3


@pytest.mark.parametrize("segments", [0, -2, "half", True, 2.0])
def test_bad_segments_are_refused(segments: object) -> None:
    with pytest.raises(ConfigError, match="segments"):
        apply_activation_checkpointing(_deep_mlp(layers=2), segments)  # type: ignore[arg-type]


def test_predicate_matching_nothing_warns() -> None:
    net = Net()
    with pytest.warns(UserWarning, match="matched no module"):
        apply_activation_checkpointing(net, lambda name, _m: name == "nope")
    assert type(net) is Net and all(type(b) is Block for b in net.blocks)


def test_non_sequential_model_needs_a_predicate() -> None:
    model = Block()
    with pytest.raises(ConfigError, match="predicate"):
        apply_activation_checkpointing(model)
    assert type(model) is Block


def test_segment_bounds_partition_evenly() -> None:
    assert segment_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert segment_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert [sqrt_segments(n) for n in (1, 4, 16, 17, 49)] == [1, 2, 4, 5, 7]
    with pytest.raises(ConfigError):
        segment_bounds(3, 4)


def test_saved_tensor_bytes_counts_unique_storages_not_parameters() -> None:
    weight = nn.Parameter(torch.randn(1000))
    x = torch.randn(1000)

    def forward() -> torch.Tensor:
        h = x * weight  # saves x (4000 bytes) and weight (a parameter: not counted)
        e = h.exp()  # saves its result e (4000 bytes)
        return e * e  # saves e twice: already counted

    assert saved_tensor_bytes(forward) == 8000
    assert saved_tensor_bytes(lambda: (x * 2).sum()) == 0  # nothing needs grad
