"""The GLUE-style BERT fine-tune (examples/recipes/glue_bert_*.py): Hugging Face's
``run_glue_no_trainer.py`` loop and the same recipe through ``torchgpu.fit`` reach the
same step losses and validation accuracy, bitwise on the CPU.

Bitwise because everything is matched, not approximated: the data order (the original
shuffles with a one-replica ``DistributedSampler``, which is torchgpu's order for any
number of processes), the weights (built under ``torch.manual_seed(seed)``), dropout
(torchgpu's probes put the RNG back, so the first step draws from where the original's
does), the parameter groups and the linear schedule (the same LambdaLR factors).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.recipes.hf_recipes import recipe
from tests.recipes.recipe import check_line_counts

SMALL = {"epochs": 2, "batch_size": 8, "train_size": 28, "warmup_steps": 2}


def test_bert_fine_tune_through_fit_equals_the_original_loop_bitwise(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    original = recipe(monkeypatch, "glue_bert_original")
    ported = recipe(monkeypatch, "glue_bert_torchgpu")
    losses, accuracy = original.main(**SMALL)
    fit_losses, fit_accuracy = ported.main(out=tmp_path / "run", **SMALL)
    assert len(losses) == 2 * 4  # 28 samples: 3 full batches and a short one per epoch
    assert fit_losses == losses  # bitwise: the same floats, step by step
    # The original counts correct predictions; fit averages batch accuracies weighted by
    # their samples: the same fraction, to float rounding.
    assert fit_accuracy == pytest.approx(accuracy, abs=1e-12)
    assert losses[-1] < losses[0]


def test_readme_states_the_recipe_lines() -> None:
    check_line_counts("glue_bert")
