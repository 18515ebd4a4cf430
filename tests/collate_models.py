"""Variable-length data for the collate tests: specs a `torchgpu train` run (and each of
its ranks) imports, e.g. ``--model tests.collate_models:classifier --data
tests.collate_models:sentences --collate-fn tests.collate_models:padding``.

The tokenizer is a real ``PreTrainedTokenizerFast`` built in memory from a ``tokenizers``
WordLevel model (no download), so ``padding`` is transformers' own
``DataCollatorWithPadding`` as a user would pass it. The items are what a tokenizer
returns without ``padding="max_length"``: dicts of Python lists of different lengths.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

WORDS = ["the", "a", "cat", "dog", "bird", "sat", "ran", "flew", "on", "under", "big",
         "small", "red", "mat", "tree"]


@functools.cache
def tokenizer() -> Any:
    """A word-level fast tokenizer over :data:`WORDS` (``[PAD]`` is id 0)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]",
                                   unk_token="[UNK]")


class Sentences(Dataset[dict[str, Any]]):
    """``n`` tokenized sentences of 2 to 9 words; the label is whether "cat" occurs."""

    def __init__(self, n: int = 48, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.texts: list[str] = []
        for _ in range(n):
            length = int(torch.randint(2, 10, (1,), generator=g))
            picks = torch.randint(0, len(WORDS), (length,), generator=g).tolist()
            self.texts.append(" ".join(WORDS[i] for i in picks))

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int) -> dict[str, Any]:
        encoded = dict(tokenizer()(self.texts[i]))  # Python lists, unpadded
        encoded["labels"] = int("cat" in self.texts[i].split())
        return encoded


class TensorSentences(Sentences):
    """The same items as tensors: they do not stack without a padding collate."""

    def __getitem__(self, i: int) -> dict[str, Any]:
        item = super().__getitem__(i)
        return {k: torch.tensor(v) for k, v in item.items()}


@dataclass
class Output:
    loss: Tensor | None
    logits: Tensor


class Classifier(nn.Module):
    """Mean of the non-padding tokens' embeddings, then a linear head; ``.loss`` is the
    cross-entropy over the batch's samples (exact under sample weighting)."""

    def __init__(self, vocab: int = len(WORDS) + 2, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, 2)

    def forward(self, input_ids: Tensor, attention_mask: Tensor,
                labels: Tensor | None = None) -> Output:
        mask = attention_mask.unsqueeze(-1).to(self.embed.weight.dtype)
        pooled = (self.embed(input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1)
        logits = self.head(pooled)
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return Output(loss, logits)


def classifier() -> Classifier:
    return Classifier()


def sentences() -> tuple[Sentences, Sentences]:
    return Sentences(48), Sentences(16, seed=1)


def tensor_sentences() -> tuple[TensorSentences, TensorSentences]:
    return TensorSentences(48), TensorSentences(16, seed=1)


def padding() -> Any:
    """The collate factory: transformers' padding collator for :func:`tokenizer`."""
    from transformers import DataCollatorWithPadding

    return DataCollatorWithPadding(tokenizer())


def broken(items: list[Any]) -> Any:
    """A collate function that raises."""
    raise KeyError("attention_mask")


def wrong_keys(items: list[Any]) -> dict[str, Tensor]:
    """A collate function whose batch the model cannot take (no attention_mask)."""
    from torch.nn.utils.rnn import pad_sequence

    ids = pad_sequence([torch.tensor(i["input_ids"]) for i in items], batch_first=True)
    return {"tokens": ids, "labels": torch.tensor([i["labels"] for i in items])}


def uneven_sentences() -> tuple[Sentences, Sentences]:
    """41 training rows: over 2 ranks in batches of 4 the last global batch holds one
    sample, so one rank's last batch is empty (collated from no items)."""
    return Sentences(41, seed=2), Sentences(12, seed=3)
