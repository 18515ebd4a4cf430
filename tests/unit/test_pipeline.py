"""Pipeline: transparency for every M and checkpoint mode, checkpointing really
recomputes, deferred BatchNorm, automatic chunks, errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from torchgpu.errors import BalanceError, ConfigError
from torchgpu.parallel.batchnorm import DeferredBatchNorm
from torchgpu.parallel.pipeline import Pipeline, choose_chunks


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(5, 12),
        nn.ReLU(),
        nn.Linear(12, 12),
        nn.GELU(),
        nn.Linear(12, 12),
        nn.Tanh(),
        nn.Linear(12, 2),
    )


class Counter(nn.Module):
    """Identity that counts forward calls (recomputation included)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("chunks", [1, 3, 4, 7])
def test_transparent_outputs_and_gradients(
    checkpoint: str, chunks: int, run_device: torch.device
) -> None:
    ref = mlp().to(run_device)
    pipe = Pipeline(
        copy.deepcopy(ref),
        [run_device] * 3,  # the GPU check: three stages on cuda:0 (streams)
        balance=[2, 3, 2],
        chunks=chunks,
        checkpoint=checkpoint,
    )
    x = torch.randn(10, 5).to(run_device)  # 10 rows: uneven micro-batches for M = 3, 4, 7
    y = torch.randn(10, 2).to(run_device)
    x_ref, x_pipe = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss_ref = nn.functional.mse_loss(ref(x_ref), y)
    out = pipe(x_pipe)
    loss = nn.functional.mse_loss(out, y.to(pipe.output_device))
    loss_ref.backward()
    loss.backward()
    torch.testing.assert_close(loss, loss_ref)
    torch.testing.assert_close(x_pipe.grad, x_ref.grad)
    for (name, p), (_, q) in zip(
        pipe.module.named_parameters(), ref.named_parameters(), strict=True
    ):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_batch_smaller_than_chunks_and_tuple_input(run_device: torch.device) -> None:
    class Add(nn.Module):
        def forward(self, xy: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return xy[0] + xy[1]

    ref = nn.Sequential(Add(), nn.Linear(3, 3)).to(run_device)
    pipe = Pipeline(copy.deepcopy(ref), [run_device, run_device], chunks=8)
    a, b = torch.randn(3, 3).to(run_device), torch.randn(3, 3).to(run_device)
    torch.testing.assert_close(pipe((a, b)), ref((a, b)))


@pytest.mark.parametrize(
    ("checkpoint", "recomputed"), [("never", 0), ("except_last", 3), ("always", 4)]
)
def test_checkpoint_recomputes_micro_batches(
    checkpoint: str, recomputed: int, run_device: torch.device
) -> None:
    counter = Counter()
    model = nn.Sequential(counter, nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    pipe = Pipeline(model, [run_device, run_device], balance=[2, 2], chunks=4,
                    checkpoint=checkpoint)
    out = pipe(torch.randn(8, 4, device=run_device))
    assert counter.calls == 4
    out.sum().backward()
    assert counter.calls == 4 + recomputed
    with torch.no_grad():  # no checkpointing without gradients
        pipe(torch.randn(8, 4, device=run_device))
    assert counter.calls == 8 + recomputed


def bn_model(momentum: float | None) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 6), nn.BatchNorm1d(6, momentum=momentum), nn.ReLU(), nn.Linear(6, 1)
    )


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_deferred_batch_norm_matches_full_batch_statistics(
    checkpoint: str, momentum: float | None, run_device: torch.device
) -> None:
    ref = bn_model(momentum).to(run_device)
    pipe = Pipeline(
        copy.deepcopy(ref),
        [run_device, run_device],
        chunks=4,
        checkpoint=checkpoint,
        deferred_batch_norm=True,
    )
    plain = Pipeline(copy.deepcopy(ref), [run_device, run_device], chunks=4,
                     checkpoint=checkpoint)
    assert len(pipe.deferred_batch_norms) == 1 and isinstance(pipe.module[1], DeferredBatchNorm)
    for step in range(3):
        x = (torch.randn(10, 4) * (step + 1) + step).to(run_device)
        ref(x).sum().backward()
        pipe(x).sum().backward()  # recomputation under checkpoint="always" must not count
        plain(x).sum().backward()
    want, got, bad = ref[1], pipe.module[1], plain.module[1]
    torch.testing.assert_close(got.running_mean, want.running_mean)
    torch.testing.assert_close(got.running_var, want.running_var)
    assert int(got.num_batches_tracked) == 3
    # micro-batch BatchNorm drifts (and double-counts when recomputing): the deferred one does not
    assert not torch.allclose(bad.running_var, want.running_var, atol=1e-3)
    ref.eval()
    pipe.eval()
    x = torch.randn(7, 4).to(run_device)
    torch.testing.assert_close(pipe(x), ref(x))
    assert list(pipe.state_dict()) == list(ref.state_dict())


def test_chunks_auto_measures_and_keeps_the_table() -> None:
    sample, target = torch.randn(16, 5), torch.randn(16, 2)
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    pipe = Pipeline(
        model,
        ["cpu", "cpu"],
        chunks="auto",
        sample=sample,
        sample_target=target,
        loss_fn=nn.functional.mse_loss,
    )
    choice = pipe.chunk_choice
    assert pipe.chunks == choice.chunks
    assert [r.chunks for r in choice.table] == [1, 2, 3, 4, 6, 8, 12, 16]
    assert all(0 < r.min_s <= r.median_s <= r.max_s for r in choice.table)
    best = min(choice.table, key=lambda r: r.median_s)
    assert best.chunks == choice.chunks
    assert "median s" in choice.format() and "*" in choice.format()
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_choose_chunks_keeps_the_gradients_already_there() -> None:
    x, y = torch.randn(8, 5), torch.randn(8, 2)
    pipe = Pipeline(mlp(), ["cpu", "cpu"], chunks=2)
    nn.functional.mse_loss(pipe(x), y).backward()  # type: ignore[no-untyped-call]
    before = [p.grad.clone() for p in pipe.parameters() if p.grad is not None]
    choose_chunks(pipe, x, y, nn.functional.mse_loss, candidates=[1, 2], steps=1, warmup=0)
    after = [p.grad for p in pipe.parameters()]
    assert len(before) == len(after) > 0
    for a, b in zip(before, after, strict=True):
        assert b is not None and torch.equal(a, b)


def test_errors() -> None:
    with pytest.raises(ConfigError, match="checkpoint='sometimes' is not a checkpoint mode"):
        Pipeline(mlp(), ["cpu", "cpu"], checkpoint="sometimes")
    with pytest.raises(ConfigError, match="chunks=0 is not a micro-batch count"):
        Pipeline(mlp(), ["cpu", "cpu"], chunks=0)
    with pytest.raises(ConfigError, match="chunks='auto' measures training steps"):
        Pipeline(mlp(), ["cpu", "cpu"], chunks="auto")
    with pytest.raises(BalanceError, match=r"balance \[7, 0\] has an empty stage"):
        Pipeline(mlp(), ["cpu", "cpu"], balance=[7, 0])
    pipe = Pipeline(mlp(), ["cpu", "cpu"], chunks=2)
    with pytest.raises(ConfigError, match="Pipeline places its stages itself"):
        pipe.to("cpu")
    with pytest.raises(ConfigError, match="chunks=-1"):
        pipe.chunks = -1
    assert not torch.cuda.is_initialized()
