"""What the Hugging Face recipes here train, built in memory (no download): a word-level
``PreTrainedTokenizerFast``, small tokenized datasets whose items have different lengths
(as a tokenizer returns them without ``padding="max_length"``) and tiny model configs.

Shared by both sides of each recipe (``*_original.py`` and ``*_torchgpu.py``), so the
line counts in README.md are the training code alone.
"""

from __future__ import annotations

import functools
import random
from typing import Any

WORDS = ["the", "a", "cat", "dog", "bird", "sat", "ran", "flew", "on", "under", "big",
         "small", "red", "mat", "tree", "good", "bad", "very", "not", "film"]


@functools.cache
def tokenizer() -> Any:
    """A word-level fast tokenizer over :data:`WORDS`: ``<pad>`` is id 0 (T5's pad and
    decoder start), ``</s>`` id 1 is appended to every text, ``<unk>`` is id 2."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(single="$A </s>",
                                                        special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>",
                                   eos_token="</s>", unk_token="<unk>")


def _texts(n: int, seed: int, shortest: int = 2, longest: int = 12) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(shortest, longest)))
            for _ in range(n)]


def sentiment(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """A GLUE-style single-sentence task, tokenized without padding: ``labels`` is 1 when
    "good" occurs more often than "bad" (SST-2's shape)."""
    items = []
    for text in _texts(n, seed):
        words = text.split()
        item = dict(tokenizer()(text))
        item["labels"] = int(words.count("good") > words.count("bad"))
        items.append(item)
    return items


def reversal(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """A sequence-to-sequence task: the target is the source's words reversed;
    ``labels`` are the target's ids (unpadded, ``</s>`` at the end)."""
    items = []
    for text in _texts(n, seed, longest=8):
        item = dict(tokenizer()(text))
        item["labels"] = tokenizer()(" ".join(reversed(text.split())))["input_ids"]
        items.append(item)
    return items


def bert_config() -> Any:
    """A 2-layer BERT of width 32 for two-class sequence classification."""
    from transformers import BertConfig

    return BertConfig(vocab_size=len(tokenizer()), hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=2, intermediate_size=64,
                      max_position_embeddings=32, pad_token_id=0, num_labels=2)


def t5_config() -> Any:
    """A T5 of width 32 with 2 encoder and 2 decoder blocks (pad and decoder start 0)."""
    from transformers import T5Config

    return T5Config(vocab_size=len(tokenizer()), d_model=32, d_kv=16, d_ff=64,
                    num_layers=2, num_decoder_layers=2, num_heads=2, pad_token_id=0,
                    eos_token_id=1, decoder_start_token_id=0)
