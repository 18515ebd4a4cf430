"""Streamed training data (an IterableDataset): the sharding rule over ranks and
workers, epochs of --steps-per-epoch, the refusals before anything is written, an
early end, and a bitwise stop/resume."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

from tests.step_limit import train_until
from tests.user_models import PairStream, SizedPairStream, StatefulPairStream, stream_model
from torchgpu import fit
from torchgpu.data.stream import StreamBatches, shards_itself
from torchgpu.errors import ConfigError, DataError, UsageError
from torchgpu.train.config import TrainConfig
from torchgpu.train.task import seeded, user_task


class Numbers(IterableDataset[torch.Tensor]):
    def __init__(self, n: int, sized: bool = False) -> None:
        self.n, self.sized = n, sized

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (torch.tensor([i]) for i in range(self.n))

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("no length")
        return self.n


def _rank_batches(source: Any, batch: int, world: int, rank: int, workers: int,
                  batches: int, length: int | None, skip: int = 0) -> list[list[int]]:
    """Rank ``rank``'s batches in the order a DataLoader with ``workers`` workers hands
    them out (worker ``b mod K`` makes batch ``b``)."""
    shard = StreamBatches(source, batch, rank=rank, world_size=world, batches=batches,
                          length=length)
    shard.begin_epoch(0, skip)
    per_worker = [iter(list(shard._sharded(k, workers))) for k in range(workers)]
    out: list[list[int]] = []
    for b in range(skip, batches):  # the DataLoader asks worker 0 first
        got = next(per_worker[(b - skip) % workers], None)
        if got is None:
            break
        out.append(got.flatten().tolist())
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("sized", [False, True])
def test_each_item_goes_to_exactly_one_rank_and_worker(world: int, workers: int,
                                                       sized: bool) -> None:
    n, batch = 23, 2
    width = world * batch
    batches = -(-n // width) if sized else 100
    ranks = [_rank_batches(Numbers(n), batch, world, r, workers, batches, n if sized else None)
             for r in range(world)]
    assert len({len(r) for r in ranks}) == 1  # every rank steps as often (DDP)
    kept = n if sized else n // width * width  # an unannounced short end is dropped
    for b in range(len(ranks[0])):
        global_batch = sorted(i for r in ranks for i in r[b])
        assert global_batch == list(range(b * width, min((b + 1) * width, kept)))
        for r in range(world):  # rank r holds items i with i mod W == r
            assert all(i % world == r for i in ranks[r][b])
    assert sorted(i for r in ranks for bs in r for i in bs) == list(range(kept))


def test_skip_resumes_the_pass_at_a_batch() -> None:
    whole = _rank_batches(Numbers(40), 3, 2, 1, 2, 6, None)
    assert _rank_batches(Numbers(40), 3, 2, 1, 2, 6, None, skip=4) == whole[4:]


def _hand_loop(data: PairStream, batch: int, batches: int, epochs: int) -> nn.Module:
    torch.manual_seed(0)
    model = stream_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(epochs):
        data.set_epoch(epoch)
        items = list(data)[:batch * batches]
        for b in range(0, len(items), batch):
            x = torch.stack([i[0] for i in items[b:b + batch]])
            y = torch.stack([i[1] for i in items[b:b + batch]])
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return model


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("sized", [False, True])
def test_a_stream_trains_as_a_hand_written_loop(tmp_path: Path, sized: bool) -> None:
    """Epoch e reads the stream from its start after set_epoch(e); the probe and the
    checks read their own passes, so training starts at the first item. With len()
    the short last batch (30 = 3 x 8 + 6) is trained; without, 4 steps per epoch."""
    data = SizedPairStream(30) if sized else PairStream(60)
    steps = {} if sized else {"steps_per_epoch": 4}
    result = fit(stream_model, data, loss=nn.MSELoss(), optimizer=_sgd, epochs=2,
                 batch_size=8, out=tmp_path / "run", progress="off", device="cpu", **steps)
    assert result.summary["steps"] == 8 and result.summary["stream_resume"] == "skip"
    expected = _hand_loop(data, 8, 4, 2)
    for (name, a), b in zip(expected.state_dict().items(),
                            result.model.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)


def _dropout_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 1))


@pytest.mark.parametrize(("accumulate", "stop_at"), [(1, 3), (1, 5), (2, 4), (2, 7)])
def test_stop_and_resume_mid_stream_is_bitwise(tmp_path: Path, accumulate: int,
                                               stop_at: int) -> None:
    settings: dict[str, Any] = {"epochs": 3, "batch_size": 4, "steps_per_epoch": 5,
                                "accumulate": accumulate, "seed": 2, "progress": "off",
                                "device": "cpu"}
    whole = fit(_dropout_model, PairStream(60), loss=nn.MSELoss(), out=tmp_path / "whole",
                **settings)
    task = user_task(seeded(_dropout_model, 2), PairStream(60), loss=nn.MSELoss(),
                     name="_dropout_model")
    config = TrainConfig(model="fit:_dropout_model", data="fit:PairStream",
                         out=str(tmp_path / "cut"), **settings)
    cut = train_until(stop_at, config, task=task)
    assert cut.summary["steps"] == stop_at and cut.summary["stopped_early"]
    resumed = fit(_dropout_model, PairStream(60), loss=nn.MSELoss(), out=tmp_path / "cut",
                  resume=True, **settings)
    assert resumed.summary["steps"] == whole.summary["steps"] == 15
    assert resumed.state.step_losses == whole.state.step_losses
    for (name, a), b in zip(whole.model.state_dict().items(),
                            resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_workers_make_the_same_batches(tmp_path: Path) -> None:
    runs = [fit(stream_model, PairStream(60), loss=nn.MSELoss(), epochs=1, batch_size=4,
                steps_per_epoch=6, num_workers=k, out=tmp_path / str(k), progress="off",
                device="cpu") for k in (0, 2)]
    assert runs[0].state.step_losses == runs[1].state.step_losses
    for a, b in zip(runs[0].model.state_dict().values(), runs[1].model.state_dict().values(),
                    strict=True):
        assert torch.equal(a, b)


def test_a_stream_that_ends_early_ends_the_epoch(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    result = fit(stream_model, PairStream(30), loss=nn.MSELoss(), epochs=2, batch_size=8,
                 steps_per_epoch=5, out=tmp_path / "run", progress="off", device="cpu")
    assert result.summary["steps"] == 6  # 3 full batches of 8 per epoch; 6 items dropped
    assert result.summary["stream_short_epochs"] == [1, 2]
    err = capsys.readouterr().err
    assert err.count("the training stream ended after 3 of the epoch's 5") == 1


@pytest.mark.parametrize(("train_data", "settings", "error", "match"), [
    (PairStream(60), {}, UsageError, "--steps-per-epoch N"),
    (PairStream(60), {"steps_per_epoch": 0}, ConfigError, "--steps-per-epoch 0 is out of"),
    (PairStream(5), {"steps_per_epoch": 2}, DataError,
     "holds 5 items, fewer than one optimizer step of 8"),
    (SizedPairStream(5), {}, DataError, "holds 5 items"),
    (Numbers(0), {"steps_per_epoch": 2}, DataError, "yields no items"),
    (TensorDataset(torch.zeros(8, 4), torch.zeros(8, 1)), {"steps_per_epoch": 2}, UsageError,
     "--steps-per-epoch 2 is for streamed training data"),
])
def test_bad_stream_recipes_are_refused_before_anything_is_written(
        tmp_path: Path, train_data: Any, settings: dict[str, Any], error: type[Exception],
        match: str) -> None:
    with pytest.raises(error, match=match):
        fit(stream_model, train_data, loss=nn.MSELoss(), epochs=1, batch_size=8,
            out=tmp_path / "run", progress="off", device="cpu", **settings)
    assert not (tmp_path / "run").exists()


def test_a_streamed_evaluation_split_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="streams are for the training data"):
        fit(stream_model, PairStream(20), eval_data=PairStream(8), loss=nn.MSELoss(),
            steps_per_epoch=1, out=tmp_path / "run", progress="off", device="cpu")


def test_auto_batch_size_searches_on_the_stream(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHGPU_SIMULATE_MEMORY_LIMIT_SAMPLES", "6")
    data = PairStream(200)
    result = fit(stream_model, data, loss=nn.MSELoss(), epochs=1, batch_size="auto",
                 effective_batch_size=16, steps_per_epoch=3, out=tmp_path / "run",
                 progress="off", device="cpu")
    micro, acc = result.summary["batch_size"], result.summary["accumulate"]
    assert micro <= 6 and micro * acc == 16 and result.summary["steps"] == 3


def test_cli_trains_a_stream_and_names_the_missing_flag(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from torchgpu.cli.main import main

    base = ["train", "--model", "tests.user_models:stream_model", "--data",
            "tests.user_models:stream_data", "--loss", "mse", "--epochs", "1",
            "--batch-size", "4", "--device", "cpu", "--progress", "off"]
    assert main([*base, "--out", str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err
    assert "--steps-per-epoch N" in err and "Traceback" not in err
    assert not (tmp_path / "no").exists()
    assert main([*base, "--steps-per-epoch", "3", "--out", str(tmp_path / "run")]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["stream_resume"] == "skip"


@pytest.mark.parametrize(("torchdata", "workers", "stop_at"),
                         [(True, 0, 7), (True, 2, 7), (True, 2, 6), (False, 0, 7)])
def test_a_stream_with_state_resumes_from_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             torchdata: bool, workers: int,
                                             stop_at: int) -> None:
    """The stream's saved state, not a re-read: the resumed pass starts after the
    trained items of epoch 2 and the run ends bitwise as the uninterrupted one."""
    if torchdata:
        pytest.importorskip("torchdata.stateful_dataloader")
    else:  # the fallback without torchdata: the batches' own state, one process
        from torchgpu.data import stream_loader

        monkeypatch.setattr(stream_loader, "_stateful_loader", lambda: None)
    settings: dict[str, Any] = {"epochs": 3, "batch_size": 4, "steps_per_epoch": 5,
                                "seed": 2, "progress": "off", "device": "cpu",
                                "num_workers": workers}
    whole = fit(_dropout_model, StatefulPairStream(60), loss=nn.MSELoss(),
                out=tmp_path / "whole", **settings)
    task = user_task(seeded(_dropout_model, 2), StatefulPairStream(60), loss=nn.MSELoss(),
                     name="_dropout_model")
    config = TrainConfig(model="fit:_dropout_model", data="fit:StatefulPairStream",
                         out=str(tmp_path / "cut"), **settings)
    train_until(stop_at, config, task=task)
    data = StatefulPairStream(60)
    resumed = fit(_dropout_model, data, loss=nn.MSELoss(), out=tmp_path / "cut",
                  resume=True, **settings)
    assert resumed.summary["stream_resume"] == "state_dict"
    if workers == 0:  # the worker processes' copies are not visible here
        assert data.resumed_at == [(stop_at - 5) * 4]  # epoch 2 resumed after its steps
    assert resumed.state.step_losses == whole.state.step_losses
    for (name, a), b in zip(whole.model.state_dict().items(),
                            resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


class _DictModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _dropout_model()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _dict_loss(output: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(output, batch["y"])


def _hf_stream(n: int = 60) -> Any:
    datasets = pytest.importorskip("datasets")
    pairs = PairStream(n)

    def rows() -> Iterator[dict[str, list[float]]]:
        for i in range(n):
            yield {"x": pairs.x[i].tolist(), "y": pairs.y[i].tolist()}

    return datasets.IterableDataset.from_generator(rows).with_format("torch")


class _DictStream(IterableDataset[dict[str, torch.Tensor]]):
    """The HF stream's items, as a plain torch stream."""

    def __init__(self, n: int = 60) -> None:
        self.data = PairStream(n)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for i in range(len(self.data.x)):
            yield {"x": self.data.x[i], "y": self.data.y[i]}


def test_a_datasets_stream_trains_and_resumes_from_its_state(tmp_path: Path) -> None:
    settings: dict[str, Any] = {"epochs": 2, "batch_size": 4, "steps_per_epoch": 4,
                                "seed": 2, "progress": "off", "device": "cpu"}
    whole = fit(_DictModel, _hf_stream(), loss=_dict_loss, out=tmp_path / "whole",
                **settings)
    plain = fit(_DictModel, _DictStream(), loss=_dict_loss, out=tmp_path / "plain",
                **settings)
    assert plain.state.step_losses == whole.state.step_losses  # read once, in order
    task = user_task(seeded(_DictModel, 2), _hf_stream(), loss=_dict_loss, name="_DictModel")
    config = TrainConfig(model="fit:_DictModel", data="fit:IterableDataset",
                         out=str(tmp_path / "cut"), **settings)
    train_until(6, config, task=task)
    resumed = fit(_DictModel, _hf_stream(), loss=_dict_loss, out=tmp_path / "cut",
                  resume=True, **settings)
    assert resumed.summary["stream_resume"] == "state_dict"
    assert resumed.state.step_losses == whole.state.step_losses
    for (name, a), b in zip(whole.model.state_dict().items(),
                            resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_a_datasets_stream_with_workers_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="split_dataset_by_node"):
        fit(_DictModel, _hf_stream(), loss=_dict_loss, steps_per_epoch=2, num_workers=2,
            out=tmp_path / "run", progress="off", device="cpu")
    assert not (tmp_path / "run").exists()


class _OwnItems(Numbers):
    """A stream that shards itself: it yields only rank 1's items of 2 (i odd), and in a
    DataLoader worker only that worker's share of them (the worker's blocks of 3)."""

    shards_itself = True

    def __iter__(self) -> Iterator[torch.Tensor]:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = [i for i in range(self.n) if i % 2 == 1]
        return (torch.tensor([i]) for j, i in enumerate(mine) if j // 3 % workers == worker)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_that_shards_itself_is_not_sharded_again(workers: int) -> None:
    from torchgpu.data.stream_loader import stream_loader

    loader = stream_loader(_OwnItems(40), 3, batches=6, rank=1, world_size=2,
                           num_workers=workers)
    loader.begin_epoch(0)
    got = [b.flatten().tolist() for b in loader]
    assert got == [[1, 3, 5], [7, 9, 11], [13, 15, 17], [19, 21, 23], [25, 27, 29],
                   [31, 33, 35]]
    for skip in (4, 3):  # a resume skips its own items; an odd one loads and drops one
        drop = loader.begin_epoch(0, skip)
        assert drop == (skip % 2 if workers else 0)
        rest = itertools.islice(loader, drop, None)
        assert [b.flatten().tolist() for b in rest] == got[skip:]


@pytest.mark.parametrize("skip", [3, 4])
def test_workers_resume_in_the_batches_order(skip: int) -> None:
    from torchgpu.data.stream_loader import stream_loader

    loader = stream_loader(Numbers(40), 3, batches=6, rank=1, world_size=2, num_workers=2)
    loader.begin_epoch(0)
    whole = [b.flatten().tolist() for b in loader]
    assert whole == [[1, 3, 5], [7, 9, 11], [13, 15, 17], [19, 21, 23], [25, 27, 29],
                     [31, 33, 35]]
    assert loader.begin_epoch(0, skip) == 0
    assert [b.flatten().tolist() for b in loader] == whole[skip:]


def test_a_saved_position_survives_reading_ahead() -> None:
    """A prefetcher reads batches ahead of the step: the state for the step's batch is
    the one kept for it, and a new loader resumes there."""
    from torchgpu.data import stream_loader as sl

    def loader() -> sl.StreamLoader:
        return sl.stream_loader(StatefulPairStream(40), 4, batches=8)

    first = loader()
    first.begin_epoch(1)
    batches = iter(first)
    seen = [next(batches) for _ in range(5)]  # trained 3, read 2 ahead
    saved = first.position_state(1, 3)
    assert saved is not None and first.position_state(1, 9) is None
    second = loader()
    second.resume_from(saved)
    assert second.begin_epoch(1, 3) == 0 and second.resumed_by == "state_dict"
    rest = list(second)
    assert torch.equal(rest[0][0], seen[3][0]) and torch.equal(rest[1][1], seen[4][1])
    assert len(rest) == 5


def test_a_datasets_stream_split_by_node_is_taken_as_it_comes(tmp_path: Path) -> None:
    from datasets.distributed import split_dataset_by_node

    settings: dict[str, Any] = {"epochs": 1, "batch_size": 4, "steps_per_epoch": 4,
                                "seed": 2, "progress": "off", "device": "cpu"}
    split = split_dataset_by_node(_hf_stream(), rank=0, world_size=1)
    assert shards_itself(split) and not shards_itself(_hf_stream())
    runs = [fit(_DictModel, data, loss=_dict_loss, out=tmp_path / str(i), **settings)
            for i, data in enumerate((split, _hf_stream()))]
    assert runs[0].state.step_losses == runs[1].state.step_losses
