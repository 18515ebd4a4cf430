"""Variable-length data: a collate function (``fit(collate_fn=)``, ``torchgpu train
--collate-fn SPEC``, ``torchgpu plan --collate-fn``) makes every batch -- training,
evaluation, the probe, the batch-size search -- with transformers' own padding collator
on tokenizer output; items that do not stack without one, and collate functions that
fail, are one paragraph (exit 2) before anything is written; a run resumes bitwise."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.collate_models import (
    Classifier,
    Sentences,
    TensorSentences,
    broken,
    classifier,
    padding,
    tokenizer,
)
from tests.step_limit import train_until
from torchgpu import fit
from torchgpu.cli.main import main
from torchgpu.data.collate import differing_shapes, resolve_collate
from torchgpu.errors import DataError, UsageError
from torchgpu.train.config import TrainConfig
from torchgpu.train.hooks.simulated_memory import SIMULATE_ENV
from torchgpu.train.task import seeded, user_task

SPECS = "tests.collate_models"
CLI = ["train", "--model", f"{SPECS}:classifier", "--data", f"{SPECS}:sentences",
       "--epochs", "1", "--batch-size", "8", "--device", "cpu", "--progress", "off"]


def test_fit_trains_tokenizer_output_with_transformers_padding_collator(
        tmp_path: Path) -> None:
    seen: list[int] = []
    collator = padding()

    def collate(items: list[Any]) -> Any:
        seen.append(len(items))
        return collator(items)

    result = fit(classifier, Sentences(48), eval_data=Sentences(16, seed=1),
                 collate_fn=collate, epochs=3, batch_size=8, lr=0.05, progress="off",
                 out=tmp_path / "run")
    assert result.summary["steps"] == 18
    losses = [r.train_loss for r in result.epochs]
    assert losses[-1] < losses[0]
    assert result.summary["final"]["test_loss"] is not None
    assert seen.count(8) == 3 * (6 + 2)  # every training and evaluation batch
    config = (tmp_path / "run" / "config.toml").read_text()
    assert 'collate_fn = "fit:collate"' in config


def test_train_collate_fn_spec_from_the_cli(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main([*CLI, "--collate-fn", f"{SPECS}:padding", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["final"]["test_loss"] is not None
    assert f'collate_fn = "{SPECS}:padding"' in (out / "config.toml").read_text()


@pytest.mark.parametrize("data", ["sentences", "tensor_sentences"])
def test_items_that_do_not_stack_are_refused_before_anything_is_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], data: str) -> None:
    out = tmp_path / "run"
    args = [a if a != f"{SPECS}:sentences" else f"{SPECS}:{data}" for a in CLI]
    assert main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--collate-fn SPEC" in err, err
    if data == "tensor_sentences":  # tensors of different lengths: the shapes are named
        first, second = (len(tokenizer()(t)["input_ids"]) for t in Sentences(2).texts)
        assert f"item 0 has input_ids of shape ({first},), item 1 ({second},)" in err
    assert not out.exists()


def test_fit_refuses_items_that_do_not_stack(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"item 0 has input_ids of shape \(\d+,\), item 1"):
        fit(classifier, TensorSentences(8), batch_size=4, progress="off", out=tmp_path / "r")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(("spec", "words"), [
    ("broken", "failed on a batch of 2 items (KeyError: 'attention_mask')"),
    ("wrong_keys", "(batched by --collate-fn tests.collate_models:wrong_keys) failed"),
    ("not_there", "has no attribute 'not_there'"),
])
def test_a_collate_function_that_fails_is_one_paragraph(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], spec: str, words: str) -> None:
    out = tmp_path / "run"
    assert main([*CLI, "--collate-fn", f"{SPECS}:{spec}", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{SPECS}:{spec}" in err and "--collate-fn" in err
    assert words in err, err
    assert not out.exists()


def test_a_collate_function_returning_neither_dict_nor_pair_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="collate_fn=<lambda> returned a str, which the mod"):
        fit(classifier, Sentences(8), collate_fn=lambda items: "batch", progress="off",
            out=tmp_path / "r")


def test_collate_fn_goes_with_a_user_model_and_dataset(capsys: pytest.CaptureFixture[str],
                                                       tmp_path: Path) -> None:
    assert main(["train", "--example", "housing", "--collate-fn", f"{SPECS}:padding",
                 "--out", str(tmp_path / "r")]) == 2
    assert "--collate-fn tests.collate_models:padding applies to your own --model" in (
        capsys.readouterr().err)


def test_a_spec_names_the_function_or_a_zero_argument_factory() -> None:
    from tests import collate_models

    assert resolve_collate(f"{SPECS}:broken") is collate_models.broken  # one argument
    made = resolve_collate(f"{SPECS}:padding")  # no argument: a factory, called once
    assert type(made).__name__ == "DataCollatorWithPadding"
    with pytest.raises(UsageError, match="the class DataCollatorWithPadding needs"):
        resolve_collate("transformers:DataCollatorWithPadding")
    with pytest.raises(UsageError, match="not callable"):
        resolve_collate(f"{SPECS}:WORDS")


def test_differing_shapes_names_the_first_difference() -> None:
    same = {"x": torch.zeros(3), "y": torch.zeros(2)}
    assert differing_shapes([same, same]) is None
    assert differing_shapes([same, {"x": torch.zeros(3), "y": torch.zeros(2, 4)}]) == (
        "item 0 has y of shape (2,), item 1 (2, 4)")
    assert differing_shapes([(torch.zeros(1, 5), 1), (torch.zeros(1, 6), 0)]) == (
        "item 0 has 0 of shape (1, 5), item 1 (1, 6)")


def test_stop_and_resume_with_a_collate_function_is_bitwise(tmp_path: Path) -> None:
    settings = {"epochs": 2, "batch_size": 8, "seed": 3, "progress": "off", "save_every": 2}
    collate = padding()
    whole = fit(classifier, Sentences(40), collate_fn=collate, out=tmp_path / "whole",
                **settings)
    task = user_task(seeded(classifier, 3), Sentences(40), name="classifier",
                     collate_fn=collate)
    config = TrainConfig(model="fit:classifier", data="fit:Sentences",
                         out=str(tmp_path / "cut"), **settings)
    stopped = train_until(3, config, task=task)  # mid-epoch, between checkpoints
    assert stopped.summary["steps"] == 3 and stopped.summary["stopped_early"]
    resumed = fit(classifier, Sentences(40), collate_fn=collate, out=tmp_path / "cut",
                  resume=True, **settings)
    assert resumed.summary["steps"] == whole.summary["steps"] == 10
    for (name, a), b in zip(whole.model.state_dict().items(),
                            resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_auto_batch_size_searches_collated_batches_and_keeps_the_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SIMULATE_ENV, "5")
    result = fit(Classifier(), Sentences(48), collate_fn=padding(), epochs=1,
                 batch_size="auto", progress="off", out=tmp_path / "run")
    summary = result.summary
    # fit's default batch (16) is the step; 5 fit, so 4 x 4 accumulation
    assert (summary["batch_size"], summary["accumulate"], summary["global_batch"]) == (4, 4, 16)


def test_plan_takes_a_collate_fn(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", f"{SPECS}:classifier", "--data", f"{SPECS}:tensor_sentences",
            "--batch-size", "8", "--devices", "1x1GiB", "--json"]
    assert main(args) == 2
    assert "--data tests.collate_models:tensor_sentences: 8 items of the data do not stack" in (
        capsys.readouterr().err)
    assert main([*args, "--collate-fn", f"{SPECS}:padding"]) == 0
    assert json.loads(capsys.readouterr().out)["workload"]["batch_size"] == 8


def test_a_dataloader_is_refused_pointing_to_its_dataset_and_collate_fn(
        tmp_path: Path) -> None:
    from torch.utils.data import DataLoader

    loader = DataLoader(Sentences(8), batch_size=4, collate_fn=padding())
    with pytest.raises(DataError, match=r"pass its dataset \(loader.dataset\) instead, its "
                       "collate function as collate_fn="):
        fit(classifier, loader, progress="off", out=tmp_path / "r")
    result = fit(classifier, loader.dataset, collate_fn=loader.collate_fn, batch_size=4,
                 epochs=1, progress="off", out=tmp_path / "r")
    assert result.summary["steps"] == 2


@pytest.mark.parametrize(("fn", "kind"), [(None, DataError), (broken, UsageError)])
def test_a_failure_in_a_dataloader_worker_is_still_one_paragraph(fn: Any, kind: type) -> None:
    """torch rebuilds a worker's exception from its traceback text: the paragraph stays."""
    from torchgpu.data import make_loader

    loader = make_loader(TensorSentences(8), 4, num_workers=1, collate_fn=fn)
    with pytest.raises(kind) as raised:
        next(iter(loader))
    assert "Traceback" not in str(raised.value) and "\n" not in str(raised.value)
    assert ("items of the data do not stack" if fn is None else
            "the collate function broken failed on a batch of 4"
            ) in str(raised.value)
