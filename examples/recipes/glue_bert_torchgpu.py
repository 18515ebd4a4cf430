"""``glue_bert_original.py`` through ``torchgpu.fit``: the same model, data, collator,
AdamW parameter groups and linear warm-up/decay; fit runs the loop (shuffling, the
model's ``.loss``, the scheduler step, evaluation) and writes the run's files.

    python examples/recipes/glue_bert_torchgpu.py
"""

from __future__ import annotations

import torch
from hf_tiny import bert_config, sentiment, tokenizer
from transformers import BertForSequenceClassification, DataCollatorWithPadding

import torchgpu


def accuracy(output, batch):
    return (output.logits.argmax(dim=-1) == batch["labels"]).float().mean().item()


def main(out=None, epochs=2, batch_size=8, lr=5e-4, warmup_steps=3, weight_decay=0.01,
         train_size=64, seed=0):
    """Train; return each step's loss and each epoch's validation accuracy."""
    result = torchgpu.fit(
        lambda: BertForSequenceClassification(bert_config()),  # under manual_seed(seed)
        sentiment(train_size, seed=1), eval_data=sentiment(32, seed=2),
        collate_fn=DataCollatorWithPadding(tokenizer()), metrics={"accuracy": accuracy},
        # In BERT the 1-D parameters are exactly the biases and LayerNorm weights.
        optimizer=lambda params: torch.optim.AdamW(
            [{"params": [p for p in params if p.ndim > 1], "weight_decay": weight_decay},
             {"params": [p for p in params if p.ndim == 1], "weight_decay": 0.0}], lr=lr),
        lr_schedule="linear", warmup_steps=warmup_steps,
        epochs=epochs, batch_size=batch_size, seed=seed, out=out, device="cpu")
    return result.state.step_losses, [r.metrics["accuracy"] for r in result.epochs]


if __name__ == "__main__":
    main()
