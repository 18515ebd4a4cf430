"""Tied weights: a checkpoint holding any one name of a tied tensor loads strictly.

Hugging Face ``save_pretrained`` keeps one name of each tie (GPT-2 drops
``lm_head.weight``, which is ``transformer.wte.weight``); the other names are filled by
the tie, not missing. Untied models still report real missing keys.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from torchgpu.checkpoint import load_state_dict
from torchgpu.errors import CheckpointError


class TiedLM(nn.Module):
    """Embedding and output layer sharing one weight, like a language model's."""

    def __init__(self, seed: int, tie: bool = True) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        if tie:
            self.head.weight = self.embed.weight


def only(state: dict[str, torch.Tensor], drop: str) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items() if k != drop}


def assert_same_weights(model: nn.Module, reference: nn.Module) -> None:
    got, want = model.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("drop", ["head.weight", "embed.weight"])
def test_plain_module_checkpoint_with_one_name_of_a_tie_loads(tmp_path: Path, drop: str) -> None:
    saved = TiedLM(seed=1)
    path = tmp_path / "w.safetensors"
    save_file(only(saved.state_dict(), drop), str(path))
    model = TiedLM(seed=2)
    report = load_state_dict(model, path)
    assert report.missing == () and report.unexpected == ()
    assert_same_weights(model, saved)
    assert model.head.weight is model.embed.weight  # still one tensor


def test_untied_model_still_reports_the_missing_key(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_file(only(TiedLM(seed=1).state_dict(), "head.weight"), str(path))
    with pytest.raises(CheckpointError, match=r"Missing in the checkpoint \(1\): head\.weight"):
        load_state_dict(TiedLM(seed=2, tie=False), path)
    report = load_state_dict(TiedLM(seed=2, tie=False), path, strict=False)
    assert report.missing == ("head.weight",)


def test_non_strict_report_does_not_list_names_filled_through_the_tie() -> None:
    state = only(TiedLM(seed=1).state_dict(), "head.weight")
    del state["body.bias"]
    report = load_state_dict(TiedLM(seed=2), state, strict=False)
    assert report.missing == ("body.bias",)


def assert_same_weights_as(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key


def tiny_gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=16,
                                     n_positions=8, bos_token_id=0, eos_token_id=0)
    model: nn.Module = transformers.GPT2LMHeadModel(config)
    return model


def test_hugging_face_gpt2_save_pretrained_directory_loads(tmp_path: Path) -> None:
    torch.manual_seed(1)
    saved = tiny_gpt2()
    saved.save_pretrained(tmp_path / "hf")  # type: ignore[operator]
    stored = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert "lm_head.weight" not in stored and "transformer.wte.weight" in stored
    torch.manual_seed(2)
    model = tiny_gpt2()
    report = load_state_dict(model, tmp_path / "hf")
    assert report.missing == () and report.unexpected == ()
    assert_same_weights(model, saved)
    assert model.lm_head.weight is model.transformer.wte.weight  # type: ignore[union-attr]


def test_gpt2_checkpoint_holding_lm_head_but_not_wte_loads(tmp_path: Path) -> None:
    torch.manual_seed(1)
    saved = tiny_gpt2()
    path = tmp_path / "w.safetensors"
    save_file(only(saved.state_dict(), "transformer.wte.weight"), str(path))
    torch.manual_seed(2)
    model = tiny_gpt2()
    load_state_dict(model, path)
    assert_same_weights(model, saved)
