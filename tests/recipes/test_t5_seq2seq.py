"""The T5 sequence-to-sequence fine-tune (examples/recipes/t5_seq2seq_*.py): Hugging
Face's ``run_summarization_no_trainer.py`` loop with ``gradient_checkpointing_enable()``
and the same recipe through ``torchgpu.fit(activation_checkpointing="T5Block")`` reach
the same step and validation losses.

Not bitwise, to float rounding: the data order, weights, dropout masks, collator and
optimizer are the same, and both recompute each ``T5Block`` under non-reentrant
``torch.utils.checkpoint`` with the RNG replayed, so the first step's loss is bitwise
equal; but torchgpu runs each checkpointed block on copies of its input tensors (so an
in-place first layer cannot corrupt the saved input), which adds a copy node where the
encoder output and the shared position bias enter each block, and autograd then sums
the gradients meeting at those tensors in another order (the encoder weights' gradients
differ in the last bits, ~1e-8; without the copies they are bitwise Hugging Face's).
AdamW carries that forward: the losses agree to ~1e-7, checked at rtol 1e-5.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.recipes.hf_recipes import recipe
from tests.recipes.recipe import check_line_counts

SMALL = {"epochs": 2, "batch_size": 4, "train_size": 14}


# transformers 5 renames the original's call (activation_checkpointing_enable); 4.x has
# only this name.
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated")
def test_t5_fine_tune_through_fit_equals_the_original_loop(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    original = recipe(monkeypatch, "t5_seq2seq_original")
    ported = recipe(monkeypatch, "t5_seq2seq_torchgpu")
    losses, eval_losses = original.main(**SMALL)
    fit_losses, fit_eval_losses = ported.main(out=tmp_path / "run", **SMALL)
    assert len(losses) == len(fit_losses) == 2 * 4  # 14 samples: 3 batches of 4 and one of 2
    assert fit_losses[0] == losses[0]  # before any update: the same forward, bitwise
    assert fit_losses == pytest.approx(losses, rel=1e-5)
    assert fit_eval_losses == pytest.approx(eval_losses, rel=1e-5)
    assert losses[-1] < losses[0]


def test_readme_states_the_recipe_lines() -> None:
    check_line_counts("t5_seq2seq")
