"""A recipe's usual slips, given through the command line with file specs
(``torchgpu train --model f.py:model --data f.py:data --collate-fn f.py:collate
--scheduler f.py:schedule``), are refused before anything is written: one paragraph
naming the spec and what its value means, exit 2.

(tests/unit/test_collate.py covers collate functions that raise or return the wrong
keys, tests/unit/test_lr_schedule.py scheduler factories that fail, return a list, a
ReduceLROnPlateau or another optimizer's scheduler; these are the Hugging Face recipes'
own mistakes.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from torchgpu.cli.main import main

RECIPE = '''
import torch
from transformers import DataCollatorWithPadding

from tests.collate_models import classifier as model  # noqa: F401
from tests.collate_models import sentences as data  # noqa: F401
from tests.collate_models import tokenizer


class Pairs(torch.utils.data.Dataset):
    """Sequence-to-sequence items: labels of different lengths, unpadded."""

    texts = ["the cat sat on the mat", "a dog ran", "the big red bird flew"]

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        item = dict(tokenizer()(self.texts[i]))
        item["labels"] = tokenizer()(" ".join(reversed(self.texts[i].split())))["input_ids"]
        return item


def seq2seq_data():
    return Pairs(), None


def padding():
    return DataCollatorWithPadding(tokenizer())


def padding_for(tokenizer):  # a factory taking an argument
    return DataCollatorWithPadding(tokenizer)


def no_return(optimizer):
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def lr_factor(optimizer):  # the factor, not a scheduler of it
    return lambda step: min(1.0, (step + 1) / 10)


def lightning(optimizer):
    return {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 10), "interval": "step"}
'''


def _train(tmp_path: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    spec = tmp_path / "recipe.py"
    spec.write_text(RECIPE)
    out = tmp_path / "run"
    args = [f.format(spec=spec) for f in flags]
    code = main(["train", "--model", f"{spec}:model", *args, "--epochs", "1",
                 "--batch-size", "2", "--device", "cpu", "--progress", "off",
                 "--out", str(out)])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2, err
    assert "Traceback" not in err and err.startswith("torchgpu: "), err
    assert not out.exists()  # nothing written
    return err


def test_padding_collator_on_seq2seq_labels_names_the_spec_and_labels(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # DataCollatorWithPadding pads input_ids, not labels: the seq2seq recipe needs
    # DataCollatorForSeq2Seq. transformers' own words name the field.
    err = _train(tmp_path, capsys, "--data", "{spec}:seq2seq_data",
                 "--collate-fn", "{spec}:padding")
    assert f"--collate-fn {tmp_path / 'recipe.py'}:padding failed on a batch of 2 items" in err
    assert "(`labels` in this case)" in err, err


def test_a_collate_factory_taking_an_argument_is_named_as_such(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _train(tmp_path, capsys, "--data", "{spec}:data", "--collate-fn",
                 "{spec}:padding_for")
    assert "padding_for returned a DataCollatorWithPadding (a function: a factory taking " \
           "an argument is called as the collate function" in err, err


@pytest.mark.parametrize(("factory", "words"), [
    ("no_return", "returned a NoneType, not a learning-rate scheduler (it has no step, "
     "state_dict, load_state_dict); it returned nothing: add `return scheduler`"),
    ("lr_factor", "returned a function, not a learning-rate scheduler (it has no step, "
     "state_dict, load_state_dict); a function: if it is the learning-rate factor of a "
     "step, return torch.optim.lr_scheduler.LambdaLR(optimizer, that_function)"),
    ("lightning", "returned a dict, not a learning-rate scheduler (it has no step, "
     "state_dict, load_state_dict); a Lightning-style {'scheduler': ...} dict: return its "
     "scheduler itself"),
])
def test_a_scheduler_factory_returning_no_scheduler_says_what_it_returned(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], factory: str, words: str) -> None:
    err = _train(tmp_path, capsys, "--data", "{spec}:data", "--collate-fn", "{spec}:padding",
                 "--scheduler", f"{{spec}}:{factory}")
    assert f"the scheduler factory --scheduler {tmp_path / 'recipe.py'}:{factory} " in err
    assert words in err, err
