"""Multi-process pipeline on torch.distributed.pipelining (gloo ranks on 127.0.0.1)
matches the single-process model — also on batches that ``chunks`` does not divide, on a
later batch of another size, with gradients accumulated over two batches, and with a
middle rank that learns the batch size from rank 0; schedule rules are checked up front."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.procs import run_torchrun
from torchgpu.errors import ConfigError
from torchgpu.parallel.chunks import micro_batch_groups
from torchgpu.parallel.stage_schedules import check_schedule
from torchgpu.parallel.stages import StagePipeline
from torchgpu.parallel.stages_demo import demo_batch, demo_model

WIDTH, LAYERS, LR, SEED = 16, 4, 0.1, 0
# 10 rows in 4 micro-batches are 3, 3, 2, 2 (two schedules); 12 then 8 changes the
# micro-batch shape after the first step; the optimizer steps every 2 batches.
BATCHES, STEPS, ACCUMULATE = (10, 12, 8), 4, 2
RUNS = {  # ranks -> schedule:chunks[:stages_per_rank]
    2: ["gpipe:4", "1f1b:4", "interleaved1f1b:4:2", "gpipe:1"],
    # a middle rank; 1F1B runs its 2-micro-batch groups as GPipe, interleaved as looped BFS
    3: ["1f1b:4", "interleaved1f1b:3:2"],
}


def single_process() -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor],
                              torch.Tensor]:
    """The demo's training on one process: losses, weights, last gradients, last output."""
    model = demo_model(WIDTH, LAYERS, SEED)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], {}
    for i in range(STEPS):
        x, y = demo_batch(BATCHES[i % len(BATCHES)], WIDTH, SEED)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        losses.append(loss.item())
        if (i + 1) % ACCUMULATE == 0 or i + 1 == STEPS:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            opt.step()
            opt.zero_grad()
    model.eval()
    with torch.no_grad():
        output = model(x)
    return losses, model.state_dict(), grads, output


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor],
                         torch.Tensor]:
    return single_process()


@pytest.mark.slow
@pytest.mark.parametrize("ranks", sorted(RUNS))
def test_gloo_ranks_match_single_process(tmp_path: Path, ranks: int, reference: Any) -> None:
    configs = RUNS[ranks]
    args = [
        "torchgpu.parallel.stages_demo", "--configs", ",".join(configs),
        "--steps", str(STEPS), "--batches", ",".join(map(str, BATCHES)),
        "--accumulate", str(ACCUMULATE), "--width", str(WIDTH), "--layers", str(LAYERS),
        "--lr", str(LR), "--out", str(tmp_path),
    ]
    proc = run_torchrun("-m", ranks, args, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses, params, grads, output = reference
    for config in configs:
        stem = config.replace(":", "_")
        got = [torch.load(tmp_path / f"{stem}_rank{r}.pt", weights_only=True)
               for r in range(ranks)]
        assert all(g["losses"] == [] and g["output"] is None for g in got[:-1])  # last only
        assert got[-1]["losses"] == pytest.approx(losses, rel=1e-5), config
        torch.testing.assert_close(got[-1]["output"], output, msg=f"{config} output")
        got_params = {k: v for g in got for k, v in g["params"].items()}
        got_grads = {k: v for g in got for k, v in g["grads"].items()}
        assert sorted(got_params) == sorted(params), config  # canonical keys, all layers
        assert sum(len(g["params"]) for g in got) == len(params)  # each layer on one rank
        for k in params:
            torch.testing.assert_close(got_params[k], params[k], msg=f"{config} {k}")
        for k in grads:
            torch.testing.assert_close(got_grads[k], grads[k], msg=f"{config} {k}")


def test_micro_batch_groups_follow_tensor_split() -> None:
    for rows in range(1, 30):
        for chunks in range(1, 12):
            groups = micro_batch_groups(rows, chunks)
            sizes = [each for count, each in groups for _ in range(count)]
            expected = [len(t) for t in torch.tensor_split(torch.arange(rows), min(rows, chunks))]
            assert sizes == expected, (rows, chunks)
            assert len(groups) <= 2 and all(count >= 1 for count, _ in groups)
    assert micro_batch_groups(10, 4) == [(2, 3), (2, 2)]
    with pytest.raises(ConfigError, match="cannot split 0 rows"):
        micro_batch_groups(0, 4)


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


def test_step_arguments_are_checked_before_any_communication() -> None:
    def pipe(rank: int) -> StagePipeline:
        return StagePipeline(demo_model(4, 2, 0), device="cpu", loss_fn=nn.functional.mse_loss,
                             chunks=2, rank=rank, world_size=2)

    x, y = demo_batch(10, 4, 0)
    with pytest.raises(ConfigError, match="rank 0 holds the first stage"):
        pipe(0).step(None, y)
    with pytest.raises(ConfigError, match="rank 1 holds the last stage, so it needs the labels"):
        pipe(1).step(None, None)
    with pytest.raises(ConfigError, match="x has 10 rows, rows has 8 rows"):
        pipe(0).step(x, None, rows=8)
    with pytest.raises(ConfigError, match="a batch of 0 rows"):
        pipe(0).step(x[:0], None)
    with pytest.raises(ConfigError, match="chunks=0 must be a positive integer"):
        pipe(0).forward(x, chunks=0)


def test_sweep_candidates_and_true_rows() -> None:
    from torchgpu.parallel.chunks import ChunkRow, even_candidates, sweep_chunks

    assert even_candidates(30) == [1, 2, 3, 6]  # equal splits of >= 2 rows
    assert even_candidates(16) == [1, 2, 4, 8]
    assert even_candidates(3) == [1]
    choice = sweep_chunks(lambda m: lambda: None, [4, 8, 24], 30, steps=1, warmup=0)
    rows = {r.chunks: (r.micro_batch_rows, r.min_micro_batch_rows) for r in choice.table}
    assert rows == {4: (8, 7), 8: (4, 3), 24: (2, 1)}
    table = choice.format().splitlines()
    assert table[0].split()[:2] == ["M", "rows"]
    assert [line.split()[1] for line in table[1:]] == ["7-8", "3-4", "1-2"]
    assert ChunkRow(4, 5, 0.1, 0.1, 0.1).rows_label() == "5"  # built without the minimum


def test_one_rank_batchnorm_sees_each_micro_batch_once(tmp_path: Path) -> None:
    """In process (a 1-rank gloo group holding both stages of an interleaved schedule):
    uneven micro-batches and a second batch size, against the model run on the same
    micro-batches by hand. torch's shape inference of every new stage (a forward and,
    on the second stage, a backward) must not add BatchNorm updates nor break on them."""
    import copy

    import torch.distributed as dist

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(),
                          nn.Flatten(), nn.Linear(3 * 4 * 4, 2))
    ref = copy.deepcopy(model)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        pipe = StagePipeline(model, device="cpu", loss_fn=nn.functional.mse_loss, chunks=4,
                             schedule="interleaved1f1b", stages_per_rank=2, balance=[1, 4])
        for rows in (10, 8, 10):
            x, y = torch.randn(rows, 2, 4, 4), torch.randn(rows, 2)
            loss = pipe.step(x, y)
            expected = 0.0
            for xs, ys in zip(torch.tensor_split(x, 4), torch.tensor_split(y, 4), strict=True):
                part = nn.functional.mse_loss(ref(xs), ys) * (len(xs) / rows)
                part.backward()  # type: ignore[no-untyped-call]
                expected += part.item()
            assert loss is not None and float(loss) == pytest.approx(expected, rel=1e-6)
        counts = [m.num_batches_tracked for m in (model[1], ref[1])]
        assert [int(c) for c in counts if isinstance(c, torch.Tensor)] == [12, 12]
        for a, b in zip([*model.parameters(), *model.buffers()],
                        [*ref.parameters(), *ref.buffers()], strict=True):
            torch.testing.assert_close(a, b)
            if isinstance(a, nn.Parameter):
                torch.testing.assert_close(a.grad, b.grad)
        pipe.train(False)
        ref.eval()
        x = torch.randn(7, 2, 4, 4)
        torch.testing.assert_close(pipe.forward(x, chunks=3), ref(x).detach())
    finally:
        dist.destroy_process_group()
