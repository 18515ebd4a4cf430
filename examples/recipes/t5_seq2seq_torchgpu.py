"""``t5_seq2seq_original.py`` through ``torchgpu.fit``: the same model, data and
collator; fit runs the loop (shuffling, the model's ``.loss``, evaluation) with its
activation checkpointing (T5's blocks recomputed in backward, the key/value cache off
while checkpointed, as ``gradient_checkpointing_enable()`` does) and AdamW, its default
optimizer.

    python examples/recipes/t5_seq2seq_torchgpu.py
"""

from __future__ import annotations

import torch
from hf_tiny import reversal, t5_config, tokenizer
from transformers import DataCollatorForSeq2Seq, T5ForConditionalGeneration

import torchgpu


def main(out=None, epochs=2, batch_size=8, lr=3e-3, train_size=64, seed=0):
    """Train; return each step's loss and each epoch's validation loss."""
    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(t5_config())
    result = torchgpu.fit(
        model, reversal(train_size, seed=1), eval_data=reversal(train_size // 2, seed=2),
        collate_fn=DataCollatorForSeq2Seq(tokenizer(), model=model, label_pad_token_id=-100),
        activation_checkpointing="T5Block", lr=lr, epochs=epochs, batch_size=batch_size,
        seed=seed, out=out, device="cpu")
    return result.state.step_losses, [r.test_loss for r in result.epochs]


if __name__ == "__main__":
    main()
