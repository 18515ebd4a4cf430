"""GLUE-style BERT fine-tuning as Hugging Face's ``run_glue_no_trainer.py`` writes it
(without Accelerate, on the CPU): a tiny ``BertForSequenceClassification`` from a config,
tokenized sentences of different lengths padded per batch by ``DataCollatorWithPadding``,
AdamW (no weight decay on biases and LayerNorm weights), a linear warm-up/decay schedule,
the model's own ``.loss`` from ``labels``, accuracy on the validation split each epoch.

    python examples/recipes/glue_bert_original.py
"""

from __future__ import annotations

import math

import torch
from hf_tiny import bert_config, sentiment, tokenizer
from torch.utils.data import DataLoader, DistributedSampler
from transformers import (
    BertForSequenceClassification,
    DataCollatorWithPadding,
    get_linear_schedule_with_warmup,
)


def main(epochs=2, batch_size=8, lr=5e-4, warmup_steps=3, weight_decay=0.01, train_size=64,
         seed=0):
    """Train; return each step's loss and each epoch's validation accuracy."""
    torch.manual_seed(seed)
    model = BertForSequenceClassification(bert_config())
    train_dataset, eval_dataset = sentiment(train_size, seed=1), sentiment(32, seed=2)

    data_collator = DataCollatorWithPadding(tokenizer())
    # Shuffled as DistributedSampler does (epoch e: randperm from seed + e), which is
    # torchgpu's order for any number of processes, one included.
    sampler = DistributedSampler(train_dataset, num_replicas=1, rank=0, seed=seed)
    train_dataloader = DataLoader(train_dataset, sampler=sampler, collate_fn=data_collator,
                                  batch_size=batch_size)
    eval_dataloader = DataLoader(eval_dataset, collate_fn=data_collator,
                                 batch_size=batch_size)

    no_decay = ["bias", "LayerNorm.weight"]
    optimizer_grouped_parameters = [
        {"params": [p for n, p in model.named_parameters()
                    if not any(nd in n for nd in no_decay)],
         "weight_decay": weight_decay},
        {"params": [p for n, p in model.named_parameters()
                    if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=lr)
    max_train_steps = epochs * math.ceil(len(train_dataloader))
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer, num_warmup_steps=warmup_steps, num_training_steps=max_train_steps)

    losses, accuracies = [], []
    for epoch in range(epochs):
        model.train()
        sampler.set_epoch(epoch)
        for batch in train_dataloader:
            outputs = model(**batch)
            loss = outputs.loss
            loss.backward()
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())

        model.eval()
        correct = 0
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            correct += int((outputs.logits.argmax(dim=-1) == batch["labels"]).sum())
        accuracies.append(correct / len(eval_dataset))
        print(f"epoch {epoch}: loss {losses[-1]:.4f}, accuracy {accuracies[-1]:.3f}")
    return losses, accuracies


if __name__ == "__main__":
    main()
