"""Activation checkpointing on real models: Hugging Face T5 (encoder-decoder, its
blocks read and write a key/value cache) and GPT-2 train as without it; a CNN with no
repeated block is checkpointed by naming its block class
(``--activation-checkpointing CLASS`` / ``fit(activation_checkpointing="CLASS")``), and
a class the model lacks is refused listing the classes it has."""

from __future__ import annotations

import copy
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from torchgpu import fit
from torchgpu.cli.main import main
from torchgpu.errors import ConfigError
from torchgpu.memory.activation_checkpointing import (
    apply_activation_checkpointing,
    checkpointing_report,
)

transformers = pytest.importorskip("transformers")

VOCAB = 64


def _t5() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=2,
        num_heads=2, dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0)
    return transformers.T5ForConditionalGeneration(config)


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2,
                                     n_positions=16, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


class _Tokens(Dataset[dict[str, Tensor]]):
    """Token batches as dicts: T5 maps a sequence to its reverse, GPT-2 models it."""

    def __init__(self, n: int, seq2seq: bool) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, VOCAB, (n, 8), generator=g)
        self.seq2seq = seq2seq

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        ids = self.ids[i]
        return {"input_ids": ids, "labels": ids.flip(0) if self.seq2seq else ids}


MODELS = {"t5": (_t5, True, "T5Block"), "gpt2": (_gpt2, False, "GPT2Block")}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_hugging_face_model_gradients_match_without_checkpointing(name: str) -> None:
    make, seq2seq, block = MODELS[name]
    plain = make()
    plain.train()
    checkpointed = apply_activation_checkpointing(copy.deepcopy(plain))
    report = checkpointing_report(checkpointed)
    assert report.class_name == block and report.count == (4 if seq2seq else 2)
    batch = _Tokens(4, seq2seq)[0]
    batch = {k: v.repeat(3, 1) for k, v in batch.items()}
    losses = []
    for model in (plain, checkpointed):
        torch.manual_seed(1)  # the same dropout masks (checkpointing replays the RNG)
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])
    for (key, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        # T5 feeds the first block's position bias to every block: the gradients that
        # meet there are summed in another order, so equal up to float rounding.
        assert a.grad is not None and b.grad is not None, key
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=key)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fit_trains_hugging_face_models_with_checkpointing(tmp_path: Path, name: str) -> None:
    make, seq2seq, block = MODELS[name]
    settings: dict[str, Any] = {"epochs": 1, "batch_size": 4, "progress": "off", "lr": 1e-2}
    runs = {}
    for setting in (False, True, block):
        runs[setting] = fit(make, _Tokens(12, seq2seq), out=tmp_path / str(setting),
                            activation_checkpointing=setting, **settings)
    base = runs[False]
    for setting in (True, block):
        result = runs[setting]
        assert result.summary["activation_checkpointing"] == setting
        assert result.summary["final"]["train_loss"] == pytest.approx(
            base.summary["final"]["train_loss"], rel=1e-5)
        for (key, a), b in zip(base.model.state_dict().items(),
                                result.model.state_dict().values(), strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=key)


_CNN = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

class ConvUnit(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))

class Net(nn.Module):  # no block repeated in a container: nothing to detect
    def __init__(self):
        super().__init__()
        self.stem, self.body = ConvUnit(3, 8), ConvUnit(8, 8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(self.body(self.stem(x)).mean(dim=(2, 3)))

def make():
    torch.manual_seed(0)
    return Net()

def data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(32, 3, 8, 8, generator=g),
                         torch.randint(0, 4, (32,), generator=g))
"""


def _cnn_args(tmp_path: Path) -> list[str]:
    spec = tmp_path / "cnn_model.py"
    spec.write_text(textwrap.dedent(_CNN))
    return ["train", "--model", f"{spec}:make", "--data", f"{spec}:data", "--loss",
            "cross_entropy", "--epochs", "1", "--batch-size", "8", "--device", "cpu",
            "--progress", "off"]


def test_cnn_block_named_on_the_command_line(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import load_file

    args = _cnn_args(tmp_path)
    # The bare flag finds no repeated block: the message says how to name one.
    assert main([*args, "--activation-checkpointing", "--out", str(tmp_path / "auto")]) == 2
    err = capsys.readouterr().err
    assert "--activation-checkpointing CLASS" in err and "ConvUnit x2" in err, err
    assert 'activation_checkpointing="CLASS"' in err and "Traceback" not in err
    assert main([*args, "--activation-checkpointing", "ConvUnit",
                 "--out", str(tmp_path / "named")]) == 0
    assert "2 x ConvUnit recomputed in backward" in capsys.readouterr().err
    assert main([*args, "--out", str(tmp_path / "plain")]) == 0
    named = load_file(tmp_path / "named" / "model.safetensors")
    plain = load_file(tmp_path / "plain" / "model.safetensors")
    assert named.keys() == plain.keys()
    assert all(torch.equal(named[k], plain[k]) for k in named)  # BatchNorm stats included


def test_unknown_block_class_lists_the_candidates(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    args = _cnn_args(tmp_path)
    assert main([*args, "--activation-checkpointing", "BasicBlock",
                 "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "no module of class 'BasicBlock'" in err and "ConvUnit x2" in err, err
    assert not (tmp_path / "r").exists()  # refused before anything was written


def test_a_named_class_is_checkpointed_instead_of_the_detected_one() -> None:
    from torchgpu.memory.block_names import checkpoint_for_run

    model = _t5()
    with pytest.raises(ConfigError, match="T5Block x4"):
        checkpoint_for_run(model, "T5Blok")
    line = checkpoint_for_run(model, "T5LayerFF")  # the wrong one auto would not pick
    assert "4 x T5LayerFF" in line


def test_a_class_name_under_stage_strategies_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["train", "--example", "housing", "--strategy", "model", "--devices",
                 "cpu,cpu", "--activation-checkpointing", "Linear", "--out",
                 str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and "checkpoints each stage's layers in segments" in err, err
