"""torch/examples' MNIST recipe: the plain loop (examples/recipes/mnist_original.py) and
the same training through torchgpu.fit (mnist_torchgpu.py) are bitwise equal on CPU:
same initial weights (the factory under torch.manual_seed(seed)), the same shuffled
order (DistributedSampler's, seed + epoch), the same dropout masks (global RNG, touched
by nothing else in between: the fit probe puts it back), Adadelta and the per-epoch
StepLR."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.recipes.recipe import check_line_counts, load


@pytest.mark.slow
def test_fit_equals_the_plain_loop_bitwise(tmp_path: Path) -> None:
    original, ours = load("mnist_original"), load("mnist_torchgpu")
    # 3 epochs of 2 steps: the LR of epoch 3 is 0.49, two StepLR decays
    losses, model = original.train(epochs=3, samples=128, batch_size=64)
    fit_losses, fit_model = ours.train(epochs=3, samples=128, batch_size=64,
                                       out=str(tmp_path / "run"))
    assert len(losses) == 6 and fit_losses == losses
    expected = model.state_dict()
    for key, value in fit_model.state_dict().items():
        assert torch.equal(value, expected[key]), key
    assert (tmp_path / "run" / "summary.json").is_file()


def test_readme_states_the_line_counts() -> None:
    check_line_counts("mnist")
