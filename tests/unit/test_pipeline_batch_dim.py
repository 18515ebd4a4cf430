"""The pipeline never joins micro-batch outputs into something the plain model would not
return: an output whose batch is not along dim 0 (sequence-first, ``x.t()``, pairs
within a micro-batch) is refused whenever it would be joined wrongly -- also when the
micro-batch rows happen to divide its dim 0 -- while batch-first outputs whose other
dims happen to equal the rows still run; and an nn.Sequential subclass with its own
forward is refused instead of being run as a plain Sequential."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from torchgpu.errors import ConfigError, MicroBatchTypeError
from torchgpu.parallel.model import split_model
from torchgpu.parallel.pipeline import Pipeline

CPU2 = ["cpu", "cpu"]


class Lambda(nn.Module):
    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def _outcome(last: Callable[[torch.Tensor], torch.Tensor], width: int, rows: int,
             chunks: int) -> str:
    """'refused', 'equal' (to the plain model) or 'WRONG'."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(width, width), Lambda(last))
    x = torch.randn(rows, width)
    plain = ref(x)
    try:
        out = Pipeline(copy.deepcopy(ref), CPU2, chunks=chunks)(x)
    except MicroBatchTypeError as error:
        assert "dim 0" in str(error) or "later dims" in str(error), error
        return "refused"
    same = isinstance(out, torch.Tensor) and out.shape == plain.shape and torch.allclose(out, plain)
    return "equal" if same else "WRONG"


def _seq_first(length: int) -> Callable[[torch.Tensor], torch.Tensor]:
    # (rows, length * 2) -> (length, rows, 2)
    return lambda x: x.reshape(x.shape[0], length, 2).transpose(0, 1)


@pytest.mark.parametrize("length", [1, 2, 4, 8, 16, 5])
@pytest.mark.parametrize("rows", [8, 6, 12])
def test_a_sequence_first_output_is_never_joined_wrongly(length: int, rows: int) -> None:
    for chunks in range(1, rows + 1):
        outcome = _outcome(_seq_first(length), length * 2, rows, chunks)
        if length == 1 and chunks == rows:
            continue  # (1, 1, 2) per 1-row micro-batch: undecidable from shapes; documented
        assert outcome != "WRONG", (length, rows, chunks)
        if chunks > 1:  # joined: refused whatever divides what
            assert outcome == "refused", (length, rows, chunks)


@pytest.mark.parametrize("features", [1, 2, 3, 4, 8, 16, 24])
@pytest.mark.parametrize("rows", [8, 6])
def test_a_transposed_output_is_never_joined_wrongly(features: int, rows: int) -> None:
    for chunks in range(2, rows + 1):
        outcome = _outcome(lambda x: x.t(), features, rows, chunks)
        micro = -(-rows // min(chunks, rows))
        equal_rows = rows % min(chunks, rows) == 0
        if equal_rows and features == micro:
            continue  # (n, n): undecidable from shapes (n classes look the same); documented
        assert outcome == "refused", (features, rows, chunks, outcome)


def test_pairs_within_a_micro_batch_are_refused() -> None:
    """A (rows, rows) similarity matrix (CLIP-style logits) is per micro-batch."""
    for rows, chunks in ((7, 2), (10, 3), (6, 4), (3, 2)):  # micro-batches of unequal rows
        outcome = _outcome(lambda x: x @ x.t(), 4, rows, chunks)
        assert outcome == "refused", (rows, chunks)
    # Equal micro-batches give (n, n), which n classes give too: undecidable, documented.


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_a_time_major_rnn_output_is_refused(chunks: int) -> None:
    torch.manual_seed(0)

    class TimeMajor(nn.Module):  # nn.LSTM without batch_first, as so often
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(3, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lstm(x.transpose(0, 1))[0]  # (L, rows, 5)

    # L == micro-batch rows == 2: (2, 2, 5) per micro-batch
    pipe = Pipeline(nn.Sequential(nn.Identity(), TimeMajor()), CPU2, chunks=chunks)
    x = torch.randn(2 * chunks, 2, 3)
    if chunks == 1:
        pipe(x)  # one micro-batch: returned as is, nothing joined
        return
    with pytest.raises(MicroBatchTypeError, match="batch may lie along dim 1"):
        pipe(x)


@pytest.mark.parametrize("chunks", [2, 4])
@pytest.mark.parametrize("last", [
    lambda x: x[:, :2],                                   # (n, 2) with n == 2 rows: 2 classes
    lambda x: x[:, :4],                                   # (n, n) with n == 4
    lambda x: x.reshape(x.shape[0], 1, 4, 4)[:, :, :, :],  # images whose side equals n
    lambda x: x.reshape(x.shape[0], 4, 4),                # (n, L, F) with L == F == n
    lambda x: x.reshape(-1, 4),                           # flattened tokens, 4 per row
    lambda x: x.reshape(-1, 1),                           # flattened per-token values
])
def test_batch_first_outputs_that_look_alike_still_run(
    chunks: int, last: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    rows = {2: 8, 4: 8}[chunks]  # 4 and 2 rows per micro-batch
    outcome = _outcome(last, 16, rows, chunks)
    if outcome == "refused":
        # Only the documented doubts: a time-major look-alike (dim 1 == rows, 3+ dims), or
        # dim 0 a multiple > 1 of the rows with a later dim of exactly the rows.
        n = rows // chunks
        shape = last(torch.zeros(n, 16)).shape
        assert (len(shape) >= 3 and shape[1] == n) or (shape[0] > n and n in shape[1:]), shape
    else:
        assert outcome == "equal"


def test_micro_batches_of_one_row_keep_their_size_one_dims() -> None:
    for last in (lambda x: x[:, :1], lambda x: x.reshape(x.shape[0], 1, -1),
                 lambda x: x.reshape(-1, 4)):
        assert _outcome(last, 8, 4, 4) == "equal"
    assert _outcome(_seq_first(4), 8, 4, 4) == "refused"  # (4, 1, 2): rows*4 with a 1


class Residual(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x + super().forward(x)


class Built(nn.Sequential):  # only __init__ of its own: a plain Sequential when run
    def __init__(self) -> None:
        super().__init__(nn.Linear(4, 4), nn.ReLU())


def test_a_sequential_subclass_with_its_own_forward_is_refused() -> None:
    for build in (lambda m: split_model(m, CPU2), lambda m: Pipeline(m, CPU2, chunks=2)):
        with pytest.raises(ConfigError, match=r"cannot split a Residual.*own forward.*"
                                              r"as_sequential\(\).*plain nn.Sequential"):
            build(Residual(nn.Linear(4, 4), nn.ReLU()))
        model = Built()
        x = torch.randn(4, 4)
        expected = model(x)
        assert torch.allclose(build(model)(x), expected)

    class WithView(Residual):
        def as_sequential(self) -> nn.Sequential:
            return nn.Sequential(*self)

    split_model(WithView(nn.Linear(4, 4), nn.ReLU()), CPU2)  # the view is the contract
