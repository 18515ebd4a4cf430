"""Multi-process pipeline on torch.distributed.pipelining (2 gloo ranks on 127.0.0.1)
matches the single-process model; schedule rules are checked up front."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.procs import run_torchrun
from torchgpu.errors import ConfigError
from torchgpu.parallel.stages import StagePipeline, check_schedule, demo_batch, demo_model

WIDTH, LAYERS, BATCH, STEPS, LR, SEED = 16, 4, 12, 3, 0.1, 0
CONFIGS = ["gpipe:4", "1f1b:4", "interleaved1f1b:4:2", "gpipe:1"]


def single_process() -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model = demo_model(WIDTH, LAYERS, SEED)
    x, y = demo_batch(BATCH, WIDTH, SEED)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return losses, model.state_dict(), grads


@pytest.mark.slow
def test_two_gloo_ranks_match_single_process(tmp_path: Path) -> None:
    args = [
        "torchgpu.parallel.stages",
        "--demo",
        "--configs",
        ",".join(CONFIGS),
        "--steps",
        str(STEPS),
        "--batch",
        str(BATCH),
        "--width",
        str(WIDTH),
        "--layers",
        str(LAYERS),
        "--lr",
        str(LR),
        "--out",
        str(tmp_path),
    ]
    proc = run_torchrun("-m", 2, args, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses, params, grads = single_process()
    for config in CONFIGS:
        stem = config.replace(":", "_")
        ranks = [torch.load(tmp_path / f"{stem}_rank{r}.pt", weights_only=True) for r in (0, 1)]
        assert ranks[0]["losses"] == []  # only the last rank sees the loss
        assert ranks[1]["losses"] == pytest.approx(losses, rel=1e-5), config
        got_params = {**ranks[0]["params"], **ranks[1]["params"]}
        got_grads = {**ranks[0]["grads"], **ranks[1]["grads"]}
        assert sorted(got_params) == sorted(params), config  # canonical keys, all layers
        assert set(ranks[0]["params"]).isdisjoint(ranks[1]["params"])  # each layer on one rank
        for k in params:
            torch.testing.assert_close(got_params[k], params[k], msg=f"{config} {k}")
        for k in grads:
            torch.testing.assert_close(got_grads[k], grads[k], msg=f"{config} {k}")


@pytest.mark.parametrize(
    ("schedule", "chunks", "ranks", "spr", "pattern"),
    [
        (
            "1f1b",
            1,
            2,
            1,
            "1F1B needs at least as many micro-batches as stages, got chunks=1 for 2",
        ),
        ("1f1b", 3, 4, 1, "chunks>=4 or schedule='gpipe'"),
        ("interleaved1f1b", 3, 2, 2, "multiple of the 2 ranks, got chunks=3: use chunks=2 or 4"),
        ("gpipe", 4, 2, 2, "stages_per_rank=2 needs schedule='interleaved1f1b'"),
        ("zerobubble", 4, 2, 1, "schedule 'zerobubble' is not known"),
        ("gpipe", 0, 2, 1, "chunks=0 must be a positive integer"),
    ],
)
def test_schedule_rules(schedule: str, chunks: int, ranks: int, spr: int, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        check_schedule(schedule, chunks, ranks, spr)


def test_1f1b_refused_before_any_communication() -> None:
    # rank/world_size given: no process group is needed to hit the rule
    with pytest.raises(ConfigError, match="1F1B needs at least as many micro-batches"):
        StagePipeline(
            demo_model(4, 2, 0),
            device="cpu",
            loss_fn=nn.functional.mse_loss,
            schedule="1f1b",
            chunks=1,
            rank=0,
            world_size=2,
        )
    check_schedule("1f1b", 2, 2)
    check_schedule("gpipe", 1, 8)
