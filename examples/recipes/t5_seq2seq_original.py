"""T5 sequence-to-sequence fine-tuning as Hugging Face's
``run_summarization_no_trainer.py`` writes it (without Accelerate, on the CPU): a tiny
``T5ForConditionalGeneration`` from a config, tokenized source/target pairs of different
lengths padded per batch by ``DataCollatorForSeq2Seq`` (labels padded with -100, the
decoder inputs made from them by the model), gradient (activation) checkpointing,
AdamW, the model's own ``.loss``, the validation loss each epoch.

    python examples/recipes/t5_seq2seq_original.py
"""

from __future__ import annotations

import torch
from hf_tiny import reversal, t5_config, tokenizer
from torch.utils.data import DataLoader, DistributedSampler
from transformers import DataCollatorForSeq2Seq, T5ForConditionalGeneration


def main(epochs=2, batch_size=8, lr=3e-3, train_size=64, seed=0):
    """Train; return each step's loss and each epoch's validation loss."""
    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(t5_config())
    # Non-reentrant, as transformers 5 defaults to (4.x defaulted to reentrant).
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    train_dataset, eval_dataset = (reversal(train_size, seed=1),
                                    reversal(train_size // 2, seed=2))

    data_collator = DataCollatorForSeq2Seq(tokenizer(), model=model, label_pad_token_id=-100)
    # Shuffled as DistributedSampler does (epoch e: randperm from seed + e), which is
    # torchgpu's order for any number of processes, one included.
    sampler = DistributedSampler(train_dataset, num_replicas=1, rank=0, seed=seed)
    train_dataloader = DataLoader(train_dataset, sampler=sampler, collate_fn=data_collator,
                                  batch_size=batch_size)
    eval_dataloader = DataLoader(eval_dataset, collate_fn=data_collator,
                                 batch_size=batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    losses, eval_losses = [], []
    for epoch in range(epochs):
        model.train()
        sampler.set_epoch(epoch)
        for batch in train_dataloader:
            outputs = model(**batch)
            loss = outputs.loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())

        model.eval()
        total = 0.0
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            total += outputs.loss.item() * len(batch["labels"])
        eval_losses.append(total / len(eval_dataset))
        print(f"epoch {epoch}: loss {losses[-1]:.4f}, validation loss {eval_losses[-1]:.4f}")
    return losses, eval_losses


if __name__ == "__main__":
    main()
