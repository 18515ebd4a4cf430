"""Activation checkpointing on models the way users bring them: the repeated block is
found (a causal LM's transformer blocks, a ResNet's bottlenecks, transformers' GPT2Block),
gradients stay bitwise equal with dropout on, state_dict keys do not change, the
recompute really happens, and BatchNorm statistics are updated once."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from tests.user_models import Block, TinyCausalLM, TokenDataset
from torchgpu.errors import ConfigError
from torchgpu.memory.activation_checkpointing import (
    apply_activation_checkpointing,
    checkpointing_report,
    remove_activation_checkpointing,
)
from torchgpu.memory.repeated_blocks import find_repeated_blocks
from torchgpu.memory.saved_tensors import saved_tensor_bytes


class Bottleneck(nn.Module):
    """ResNet bottleneck: 1x1 -> 3x3 -> 1x1 convolutions with BatchNorm, a residual."""

    def __init__(self, channels: int, mid: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(channels, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv2 = nn.Conv2d(mid, mid, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(mid)
        self.conv3, self.bn3 = nn.Conv2d(mid, channels, 1, bias=False), nn.BatchNorm2d(channels)
        self.drop = nn.Dropout2d(0.1)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        h = torch.relu(self.bn2(self.conv2(h)))
        return torch.relu(x + self.drop(self.bn3(self.conv3(h))))


class TinyResNet(nn.Module):
    """Stem, two stages of bottlenecks in nn.Sequential (different lengths), a head."""

    def __init__(self, width: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = nn.Sequential(*(Bottleneck(width, width // 2) for _ in range(2)))
        self.layer2 = nn.Sequential(*(Bottleneck(width, width // 2) for _ in range(3)))
        self.fc = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.layer2(self.layer1(self.stem(x))).mean(dim=(2, 3)))


def _gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=97, n_positions=16, n_embd=32, n_layer=2, n_head=4,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
    )
    torch.manual_seed(0)
    model: nn.Module = transformers.GPT2LMHeadModel(config)
    return model


def _lm() -> nn.Module:
    torch.manual_seed(0)
    return TinyCausalLM(layers=4)


def _resnet() -> nn.Module:
    torch.manual_seed(0)
    return TinyResNet()


IDS = TokenDataset(6).ids
IMAGES = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))

Case = tuple[Callable[[], nn.Module], Callable[[nn.Module], Tensor], str, int]
CASES: dict[str, Case] = {
    "causal_lm": (_lm, lambda m: m(input_ids=IDS, labels=IDS).loss, "Block", 4),
    "resnet": (_resnet, lambda m: nn.functional.cross_entropy(m(IMAGES), torch.arange(4)),
               "Bottleneck", 5),
    "gpt2": (_gpt2, lambda m: m(input_ids=IDS % 97, labels=IDS % 97).loss, "GPT2Block", 2),
}


def _step(model: nn.Module, loss_of: Callable[[nn.Module], Tensor], seed: int = 5
          ) -> tuple[Tensor, list[Tensor]]:
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks for both models
    loss = loss_of(model)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


@pytest.mark.parametrize("case", list(CASES))
def test_repeated_block_found_and_gradients_bitwise_equal(case: str) -> None:
    build, loss_of, block_class, count = CASES[case]
    plain = build()
    ckpt = apply_activation_checkpointing(copy.deepcopy(plain))
    assert ckpt is not None
    report = checkpointing_report(ckpt)
    assert (report.mode, report.class_name, report.count) == ("blocks", block_class, count)
    assert 0.5 < report.parameter_share <= 1.0
    assert f"{count} x {block_class}" in report.describe()
    assert list(ckpt.state_dict()) == list(plain.state_dict())
    want_loss, want = _step(plain, loss_of)
    got_loss, got = _step(ckpt, loss_of)
    assert torch.equal(want_loss, got_loss)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    # BatchNorm statistics: updated once per forward, as without checkpointing
    buffers = zip(plain.buffers(), ckpt.buffers(), strict=True)
    assert all(torch.equal(a, b) for a, b in buffers)
    # dropout really was on: another seed gives another loss
    assert not torch.equal(_step(plain, loss_of, seed=6)[0], want_loss)


@pytest.mark.parametrize("case", list(CASES))
def test_blocks_are_recomputed_in_backward(case: str) -> None:
    build, loss_of, block_class, count = CASES[case]
    model = apply_activation_checkpointing(build())
    calls: list[str] = []
    modules = dict(model.named_modules())
    for name in checkpointing_report(model).names:
        assert type(modules[name]).__name__ == f"Checkpointed{block_class}"
        # a child's forward runs both in the forward and in the recompute
        next(modules[name].children()).register_forward_hook(lambda *_, n=name: calls.append(n))
    model.train()
    torch.manual_seed(0)
    loss = loss_of(model)
    assert len(calls) == count  # forward: once per block
    loss.backward()
    assert len(calls) == 2 * count  # backward recomputed every block


def test_plain_checkpoint_loads_into_the_wrapped_model_and_back() -> None:
    plain = _lm()
    ckpt = apply_activation_checkpointing(TinyCausalLM(layers=4))
    ckpt.load_state_dict(plain.state_dict())  # strict
    assert all(torch.equal(a, b) for a, b in
               zip(ckpt.state_dict().values(), plain.state_dict().values(), strict=True))
    fresh = TinyCausalLM(layers=4)
    fresh.load_state_dict(ckpt.state_dict())
    assert ckpt.head.weight is ckpt.embed.weight  # tied weights stay tied


def test_checkpointing_saves_activation_bytes_on_the_lm() -> None:
    plain = _lm().train()
    ckpt = apply_activation_checkpointing(copy.deepcopy(plain))
    ids = TokenDataset(16).ids
    plain_bytes = saved_tensor_bytes(lambda: plain(ids, labels=ids))
    ckpt_bytes = saved_tensor_bytes(lambda: ckpt(ids, labels=ids))
    assert ckpt_bytes < plain_bytes / 2, (ckpt_bytes, plain_bytes)


def test_blocks_by_class_predicate_or_tuple() -> None:
    by_class = apply_activation_checkpointing(_lm(), blocks=Block)
    assert checkpointing_report(by_class).count == 4
    by_name = apply_activation_checkpointing(_lm(), blocks=lambda n, _m: n == "blocks.1")
    assert checkpointing_report(by_name).names == ("blocks.1",)
    mlp = apply_activation_checkpointing(_lm(), blocks=(nn.Sequential,))
    report = checkpointing_report(mlp)
    assert report.class_name == "Sequential" and report.count == 4
    # nested matches wrap the outermost only: a block and its MLP are not both wrapped
    both = apply_activation_checkpointing(_lm(), blocks=(Block, nn.Sequential))
    assert checkpointing_report(both).names == tuple(f"blocks.{i}" for i in range(4))
    remove_activation_checkpointing(both)
    assert checkpointing_report(both).mode == "none"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"blocks": 3}, "blocks=3 is not allowed"),
        ({"blocks": int}, "is not allowed: give an nn.Module subclass"),
        ({"blocks": Block, "segments": 2}, "conflict"),
        ({"blocks": Block, "segments": lambda n, m: True}, "not both"),
    ],
)
def test_bad_blocks_values(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        apply_activation_checkpointing(_lm(), **kwargs)


def test_model_without_a_repeated_block_says_what_to_pass() -> None:
    model = nn.Linear(4, 4)
    wide = nn.Module()
    wide.a, wide.b = nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    for target in (model, wide):
        with pytest.raises(ConfigError) as info:
            apply_activation_checkpointing(target)
        text = str(info.value)
        assert "no repeated block" in text and "blocks=CLASS" in text and "predicate" in text
        assert "--activation-checkpointing CLASS" in text and "activation_checkpointing=" in text
        assert checkpointing_report(target).mode == "none"


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(x))


def test_choice_rules() -> None:
    # lone layers repeated in a Sequential are not blocks (checkpointing one saves nothing)
    mlp_only = nn.Module()
    mlp_only.body = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    assert find_repeated_blocks(mlp_only) is None
    # blocks without parameters are never chosen
    free = nn.Module()
    free.acts = nn.ModuleList(nn.Sequential(nn.ReLU(), nn.Tanh()) for _ in range(3))
    free.fc = nn.Linear(4, 4)
    assert find_repeated_blocks(free) is None
    # a model's own class beats a plain Sequential that holds the same parameters
    nested = nn.Module()
    nested.stages = nn.Sequential(*(nn.Sequential(_Pair(), _Pair()) for _ in range(2)))
    found = find_repeated_blocks(nested)
    assert found is not None and (found.class_name, found.count) == ("_Pair", 4)
    # the largest share wins: the big repeated block over a small repeated head
    mixed = nn.Module()
    mixed.big = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(2))
    mixed.small = nn.ModuleList(_Pair() for _ in range(2))
    found = find_repeated_blocks(mixed)
    assert found is not None and found.names == ("big.0", "big.1")
    assert found.parameter_share == pytest.approx(2 * 1056 / (2 * 1056 + 2 * 40))
