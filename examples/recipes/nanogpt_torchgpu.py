"""nanoGPT's character-level training through torchgpu.fit: nanogpt_original.py's
model, data and AdamW groups; the cosine schedule with warm-up (``lr_schedule``,
``warmup_steps``), clipping (``clip_norm``), ``compile``, shuffling, evaluation and the
run's files are torchgpu's.

    python examples/recipes/nanogpt_torchgpu.py --epochs 2 --out runs/nanogpt [--compile]
"""

from __future__ import annotations

import argparse
from functools import partial

from nanogpt_model import GPT, GPTConfig, char_splits, configure_optimizers, lm_loss
from torch import nn

from torchgpu import fit


def train(epochs: int = 2, batch_size: int = 8, lr: float = 1e-3, warmup: int = 4,
          seed: int = 1337, compile: bool = False,
          out: str | None = None) -> tuple[list[float], nn.Module]:
    """Train; return every step's loss and the trained model."""
    train_data, val_data = char_splits(block_size=32)
    config = GPTConfig(block_size=32, vocab_size=len(train_data.chars))
    result = fit(partial(GPT, config), train_data, eval_data=val_data, loss=lm_loss,
                 optimizer=lambda params: configure_optimizers(params, 0.1, lr),
                 lr_schedule="cosine", warmup_steps=warmup, clip_norm=1.0, compile=compile,
                 epochs=epochs, batch_size=batch_size, seed=seed, out=out, progress="off")
    return result.state.step_losses, result.model


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--out", default=None)
    losses, _ = train(**vars(parser.parse_args()))
    print(f"{len(losses)} steps: first loss {losses[0]:.4f}, last loss {losses[-1]:.4f}")
