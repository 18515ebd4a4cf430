"""Models and data the way users bring them: shared by the user-model tests.

- :class:`TinyCausalLM`: a GPT-style causal language model. Batches are dicts of integer
  token ids (``{"input_ids": ..., "labels": ...}``), ``forward(input_ids, labels=None)``
  returns an object with ``.loss`` and ``.logits`` (like a popular library's model
  output), the output head is tied to the token embedding, blocks sit in a
  ``nn.ModuleList`` and use dropout.
- :class:`BNConvNet`: a small CNN with BatchNorm and dropout, blocks repeated in a
  ``nn.Sequential``; trained from ``(image, label)`` pairs or dict batches with a loss.
- :class:`TokenDataset` / :class:`ImageDataset`: deterministic map-style datasets.
- :class:`PairStream`: a deterministic stream (an ``IterableDataset``) of regression pairs.

The ``*_factory`` functions and ``data_*`` functions are ``module:attr`` specs for the CLI
(``tests.user_models:lm_factory``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, IterableDataset

VOCAB = 61
SEQ = 12


@dataclass
class LMOutput:
    """What a causal LM returns: the mean token loss (when labels are given) and logits."""

    logits: Tensor
    loss: Tensor | None = None


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, with dropout."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout)
        )

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        x = x + a
        return x + self.mlp(self.ln2(x))


class TinyCausalLM(nn.Module):
    """A GPT-style LM with tied input/output embeddings (``head.weight is embed.weight``)."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32, layers: int = 3, heads: int = 4,
                 seq: int = SEQ, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, seq, dim))
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, input_ids: Tensor, labels: Tensor | None = None,
                attention_mask: Tensor | None = None) -> LMOutput:
        x = self.drop(self.embed(input_ids) + self.pos[:, : input_ids.shape[1]])
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
            )
        return LMOutput(logits=logits, loss=loss)


class TokenDataset(Dataset[dict[str, Tensor]]):
    """``n`` deterministic token sequences with a learnable pattern (next = prev + 1 mod V)."""

    def __init__(self, n: int = 64, seq: int = SEQ, vocab: int = VOCAB, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        self.ids = (start + torch.arange(seq)) % vocab

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class BNConvNet(nn.Module):
    """A CNN with BatchNorm and dropout; ``forward(image) -> logits``."""

    def __init__(self, classes: int = 5, width: int = 8) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width),
                                  nn.ReLU())
        self.stages = nn.Sequential(*(
            nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU())
            for _ in range(3)
        ))
        self.drop = nn.Dropout(0.2)
        self.fc = nn.Linear(width, classes)

    def forward(self, image: Tensor) -> Tensor:
        x = self.stages(self.stem(image))
        return self.fc(self.drop(x.mean(dim=(2, 3))))


class ImageDataset(Dataset[tuple[Tensor, Tensor]]):
    """``n`` deterministic 3x8x8 images whose label is the brightest channel (learnable)."""

    def __init__(self, n: int = 48, classes: int = 5, seed: int = 0, as_dict: bool = False
                 ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, 8, 8, generator=g)
        self.y = self.x.mean(dim=(2, 3)).argmax(dim=1) % classes
        self.as_dict = as_dict

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.x[i], self.y[i]


class DictImageDataset(ImageDataset):
    """The same images as dict batches: ``{"image": ..., "label": ...}``."""

    def __getitem__(self, i: int) -> dict[str, Tensor]:  # type: ignore[override]
        return {"image": self.x[i], "label": self.y[i]}


# ---- module:attr specs for the CLI -------------------------------------------------------
def lm_factory() -> TinyCausalLM:
    torch.manual_seed(0)
    return TinyCausalLM()


def lm_data() -> tuple[TokenDataset, TokenDataset]:
    return TokenDataset(64, seed=0), TokenDataset(16, seed=1)


def cnn_factory() -> BNConvNet:
    torch.manual_seed(0)
    return BNConvNet()


def cnn_data() -> tuple[ImageDataset, ImageDataset]:
    return ImageDataset(48, seed=0), ImageDataset(16, seed=1)


def cnn_dict_data() -> tuple[DictImageDataset, DictImageDataset]:
    return DictImageDataset(48, seed=0), DictImageDataset(16, seed=1)


def cnn_dict_loss(output: Tensor, batch: dict[str, Tensor]) -> Tensor:
    """A user loss for dict batches: ``loss(output, batch)``."""
    return nn.functional.cross_entropy(output, batch["label"])


class CNNDictWrapper(nn.Module):
    """``model(**batch)`` for dict image batches: takes ``image`` and ignores ``label``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = BNConvNet()

    def forward(self, image: Tensor, label: Tensor | None = None) -> Tensor:
        return self.net(image)


def not_a_dataset() -> nn.Module:
    """A data spec that returns a model by mistake."""
    return nn.Linear(2, 2)


def lm_factory_no_dropout() -> TinyCausalLM:
    """The LM without dropout: DDP and one process then draw no random numbers apart."""
    torch.manual_seed(0)
    return TinyCausalLM(dropout=0.0)


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """An SGD factory (``params -> Optimizer``)."""
    return torch.optim.SGD(params, lr=0.5)


def seq_factory() -> nn.Sequential:
    """A three-layer sequential regressor (pipelines cut it into stages)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def nan_row_data() -> tuple[Dataset[tuple[Tensor, Tensor]], Dataset[tuple[Tensor, Tensor]]]:
    """40 training rows, one of which holds a NaN (its batch's loss is NaN), and 8
    finite evaluation rows."""
    from torch.utils.data import TensorDataset

    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 4, generator=generator), torch.randn(40, 1, generator=generator)
    x[5, 0] = float("nan")
    return TensorDataset(x, y), TensorDataset(torch.randn(8, 4, generator=generator), y[:8])


class InPlaceToLinear(nn.Linear):
    """A model whose ``.to()`` override moves it but returns nothing (no ``return
    self``): whoever moves it must keep the module, not ``.to()``'s result."""

    def to(self, *args: object, **kwargs: object) -> None:  # type: ignore[override]
        super().to(*args, **kwargs)  # type: ignore[call-overload]


def narrow_eval_data() -> tuple[Dataset[tuple[Tensor, Tensor]], Dataset[tuple[Tensor, Tensor]]]:
    """40 training rows of 4 features (what :func:`seq_factory` takes) and 8 evaluation
    rows of 3: a held-out split of another width."""
    from torch.utils.data import TensorDataset

    generator = torch.Generator().manual_seed(0)
    return (TensorDataset(torch.randn(40, 4, generator=generator),
                          torch.randn(40, 1, generator=generator)),
            TensorDataset(torch.randn(8, 3, generator=generator),
                          torch.randn(8, 1, generator=generator)))


#: While set, :func:`failing_eval_data`'s evaluation split cannot read its sixth row.
EVAL_FAILS_ENV = "TORCHGPU_TEST_EVAL_FAILS"


class FailingRows(Dataset[tuple[Tensor, Tensor]]):
    """Rows whose sixth item raises OSError while :data:`EVAL_FAILS_ENV` is set (a file
    that went away): the first two read fine, so the evaluation fails, not a probe."""

    def __init__(self, x: Tensor, y: Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        import os

        if i == 5 and os.environ.get(EVAL_FAILS_ENV):
            raise OSError(f"row {i}: the file holding it is gone")
        return self.x[i], self.y[i]


def failing_eval_data() -> tuple[Dataset[tuple[Tensor, Tensor]], FailingRows]:
    """:func:`seq_factory`'s 40 training rows and 8 :class:`FailingRows` to evaluate on."""
    from torch.utils.data import TensorDataset

    generator = torch.Generator().manual_seed(0)
    return (TensorDataset(torch.randn(40, 4, generator=generator),
                          torch.randn(40, 1, generator=generator)),
            FailingRows(torch.randn(8, 4, generator=generator),
                        torch.randn(8, 1, generator=generator)))


def training_only_mse(output: Tensor, target: Tensor) -> Tensor:
    """MSE that fails on evaluation batches (more than the probe's two rows, without
    gradients): a loss that breaks only when the run evaluates."""
    if not torch.is_grad_enabled() and output.shape[0] > 2:
        raise ValueError("training_only_mse cannot evaluate")
    return nn.functional.mse_loss(output, target.reshape(output.shape))


def ten_rows() -> Dataset[tuple[Tensor, Tensor]]:
    """Ten training rows of four features: fewer than one batch of the default 16."""
    from torch.utils.data import TensorDataset

    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(10, 4, generator=generator),
                         torch.randn(10, 1, generator=generator))


class PairStream(IterableDataset[tuple[Tensor, Tensor]]):
    """A stream of ``n`` regression pairs ``(x of 4 features, y = x @ w + noise)``, the
    same items on every pass; each epoch (``set_epoch``) reads them in its own seeded
    order, as a shuffling stream would. ``sized``: it has ``len()``."""

    def __init__(self, n: int = 60, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(
            n, 1, generator=g)
        self.epoch = 0
        self.passes = 0  # passes started in this process (probe, checks and training)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self, epoch: int) -> list[int]:
        return torch.randperm(len(self.x), generator=torch.Generator().manual_seed(epoch)
                              ).tolist()

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        self.passes += 1
        for i in self.order(self.epoch):
            yield self.x[i], self.y[i]


class SizedPairStream(PairStream):
    def __len__(self) -> int:
        return len(self.x)


def stream_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def stream_data() -> PairStream:
    return PairStream(60)


class StatefulPairStream(PairStream):
    """A :class:`PairStream` that keeps its position (``state_dict``/``load_state_dict``,
    torchdata's Stateful protocol): a pass after ``load_state_dict`` continues where the
    saved pass stood. ``resumed_at``: the positions passes were resumed at."""

    def __init__(self, n: int = 60, seed: int = 0) -> None:
        super().__init__(n, seed)
        self.pos = 0
        self._resume = 0
        self.resumed_at: list[int] = []

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self._resume = state["epoch"], state["pos"]

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        start, self._resume = self._resume, 0
        if start:
            self.resumed_at.append(start)
        order = self.order(self.epoch)
        for self.pos in range(start + 1, len(order) + 1):
            i = order[self.pos - 1]
            yield self.x[i], self.y[i]


def stateful_stream_data() -> StatefulPairStream:
    return StatefulPairStream(60)
