"""nanoGPT's train.py (character-level, like its shakespeare_char config) as a plain
PyTorch loop at a CPU size: AdamW with weight decay, a cosine learning rate with linear
warm-up, gradient clipping at 1.0, optional torch.compile. The model is nanogpt_model.py.
The windows are read in DistributedSampler's order (randperm seeded with seed + epoch,
the order torchgpu trains in), and the schedule is Hugging Face's cosine with warm-up
(from LR 0, down to 0 at the last step; nanoGPT's own decays to lr/10).

    python examples/recipes/nanogpt_original.py --epochs 2
"""

from __future__ import annotations

import argparse
import math

import torch
from nanogpt_model import GPT, GPTConfig, char_splits, configure_optimizers, lm_loss
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler


def lr_factor(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def train(epochs: int = 2, batch_size: int = 8, lr: float = 1e-3, warmup: int = 4,
          seed: int = 1337, compile: bool = False) -> tuple[list[float], nn.Module]:
    """Train; return every step's loss and the trained model."""
    train_data, val_data = char_splits(block_size=32)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(block_size=32, vocab_size=len(train_data.chars)))
    if compile:
        model.compile()
    optimizer = configure_optimizers(list(model.parameters()), 0.1, lr)
    sampler = DistributedSampler(train_data, num_replicas=1, rank=0, shuffle=True, seed=seed)
    loader = DataLoader(train_data, batch_size=batch_size, sampler=sampler)
    total, step, losses = epochs * len(loader), 0, []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            for group in optimizer.param_groups:
                group["lr"] = lr * lr_factor(step, warmup, total)
            loss = lm_loss(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            step += 1
        model.eval()
        with torch.no_grad():
            val = [lm_loss(model(x), y).item() for x, y in DataLoader(val_data, batch_size)]
        print(f"epoch {epoch + 1}: train loss {losses[-1]:.4f}, val loss {sum(val) / len(val):.4f}")
    return losses, model


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--compile", action="store_true")
    train(**vars(parser.parse_args()))
