"""Built-in data, the CSV loader's errors, and make_loader."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from torchgpu.data import EXAMPLE_NAMES, csv_data, example_data, make_loader, set_epoch
from torchgpu.data.csv import column_letter
from torchgpu.data.housing import COLUMNS, housing_table, write_housing_csv
from torchgpu.errors import DataError
from torchgpu.models import HousingNet, LeNet5


@dataclass(frozen=True)
class Rank:
    rank: int
    world_size: int
    is_distributed: bool = True


def r2(pred: torch.Tensor, target: torch.Tensor) -> float:
    return float(1 - ((pred - target) ** 2).mean() / ((target - target.mean()) ** 2).mean())


# ---------------------------------------------------------------- housing


def test_housing_is_boston_shaped_and_deterministic() -> None:
    data = example_data("housing")
    x_train, y_train = data.train.tensors
    x_test, y_test = data.test.tensors
    assert len(x_train) + len(x_test) == 506 and len(x_test) == 101
    assert x_train.shape[1] == 13 and data.input_shape == (13,)
    assert data.feature_names == COLUMNS and data.feature_names[5] == "RM"
    assert data.target_name == "MEDV" and data.task == "regression" and data.num_outputs == 1
    assert y_train.shape == (405, 1) and y_train.dtype == torch.float32
    again = example_data("housing")
    assert torch.equal(again.train.tensors[0], x_train)
    # another seed: another split of the same table
    other = example_data("housing", seed=1)
    assert not torch.equal(other.test.tensors[1], y_test)
    all_y = sorted(torch.cat([y_train, y_test]).flatten().tolist())
    assert all_y == sorted(
        torch.cat(other.train.tensors[1:] + other.test.tensors[1:]).flatten().tolist()
    )


def test_housing_columns_have_plausible_ranges() -> None:
    features, medv = housing_table()
    col = dict(zip(COLUMNS, features.T, strict=True))
    assert set(np.unique(col["CHAS"])) == {0.0, 1.0}
    assert 5.5 < col["RM"].mean() < 7.0
    assert col["NOX"].min() >= 0.38 and col["NOX"].max() <= 0.88
    assert medv.min() >= 5.0 and medv.max() <= 50.0 and 15 < medv.mean() < 30


def test_housing_features_are_standardised_with_train_statistics() -> None:
    data = example_data("housing")
    x_train = data.train.tensors[0]
    assert torch.allclose(x_train.mean(0), torch.zeros(13), atol=1e-4)
    assert torch.allclose(x_train.std(0, unbiased=False), torch.ones(13), atol=1e-3)
    assert data.feature_mean is not None and data.feature_std is not None
    raw, _ = housing_table()
    row = (raw[0] - np.array(data.feature_mean)) / np.array(data.feature_std)
    all_x = torch.cat([x_train, data.test.tensors[0]])
    assert torch.isclose(all_x, torch.tensor(row, dtype=torch.float32), atol=1e-4).all(1).any()


def test_seed_mlp_learns_housing_beyond_a_linear_fit() -> None:
    """The seed's recipe (Adam lr 0.01, batch 128, 100 epochs) reaches test R^2 >= 0.8,
    and the target is not linear: least squares does clearly worse."""
    data = example_data("housing")
    x_test, y_test = data.test.tensors
    torch.manual_seed(0)
    model = HousingNet()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    loader = make_loader(data.train, 128, shuffle=True, seed=0)
    for _ in range(100):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        mlp = r2(model(x_test), y_test)
    x_train, y_train = data.train.tensors
    ones = torch.ones(len(x_train), 1)
    w = torch.linalg.lstsq(torch.cat([x_train, ones], 1), y_train).solution
    linear = r2(torch.cat([x_test, torch.ones(len(x_test), 1)], 1) @ w, y_test)
    assert mlp >= 0.8, mlp
    assert linear < mlp - 0.02, (linear, mlp)


# ---------------------------------------------------------------- csv


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "table.csv"
    path.write_text(text)
    return path


def test_csv_round_trip_of_the_housing_table(tmp_path: Path) -> None:
    path = write_housing_csv(tmp_path / "houses.csv")
    data = csv_data(path, target="MEDV", seed=0)
    ref = example_data("housing", seed=0)
    assert data.feature_names == COLUMNS and data.num_outputs == 1
    assert torch.allclose(data.train.tensors[0], ref.train.tensors[0], atol=1e-4)
    assert torch.allclose(data.test.tensors[1], ref.test.tensors[1], atol=1e-3)


def test_csv_target_may_be_any_column(tmp_path: Path) -> None:
    rows = "\n".join(f"{i},{i * 2.0},{i % 3}" for i in range(10))
    data = csv_data(write(tmp_path, "a,y,b\n" + rows + "\n"), "y", test_fraction=0.3)
    assert data.feature_names == ("a", "b") and data.input_shape == (2,)
    assert len(data.train) == 7 and len(data.test) == 3
    x, y = data.train.tensors
    # y = 2a exactly, and a was standardised with train statistics
    assert data.feature_mean is not None and data.feature_std is not None
    a = x[:, 0] * data.feature_std[0] + data.feature_mean[0]
    assert torch.allclose(y.flatten(), 2 * a, atol=1e-4)


def test_csv_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nope\.csv does not exist"):
        csv_data(tmp_path / "nope.csv", "y")


def test_csv_missing_target_lists_the_columns(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"no column 'price': its columns are a, b, y"):
        csv_data(write(tmp_path, "a,b,y\n1,2,3\n4,5,6\n"), "price")


@pytest.mark.parametrize(
    ("cell", "message"),
    [
        ("abc", r"row 3, column 'b' \(B\) holds 'abc', which is not a number"),
        ("", r"row 3, column 'b' \(B\) is empty"),
        ("nan", r"row 3, column 'b' \(B\) holds 'nan' \(not a finite number\)"),
        ("-inf", r"row 3, column 'b' \(B\) holds '-inf'"),
    ],
)
def test_csv_bad_cell_names_row_and_column(tmp_path: Path, cell: str, message: str) -> None:
    path = write(tmp_path, f"a,b,y\n1,2,3\n4,{cell},6\n7,8,9\n")
    with pytest.raises(DataError, match=message):
        csv_data(path, "y")


def test_csv_rows_are_numbered_as_in_a_spreadsheet_even_after_blank_lines(tmp_path: Path) -> None:
    path = write(tmp_path, "a,y\n1,2\n\n3,4\n5,x\n")
    with pytest.raises(DataError, match=r"row 5, column 'y' \(B\)"):
        csv_data(path, "y")


def test_csv_ragged_row_empty_file_and_header_only(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"row 3 has 2 cells but the header has 3 columns"):
        csv_data(write(tmp_path, "a,b,y\n1,2,3\n4,5\n"), "y")
    with pytest.raises(DataError, match="is empty"):
        csv_data(write(tmp_path, ""), "y")
    with pytest.raises(DataError, match="no data rows"):
        csv_data(write(tmp_path, "a,y\n"), "y")
    with pytest.raises(DataError, match="only the target column"):
        csv_data(write(tmp_path, "y\n1\n2\n"), "y")


def test_csv_fewer_rows_than_one_batch(tmp_path: Path) -> None:
    path = write(tmp_path, "a,y\n" + "".join(f"{i},{i}\n" for i in range(10)))
    with pytest.raises(DataError, match=r"10 data rows.*8 rows.*batch of 16.*--batch-size 8"):
        csv_data(path, "y", batch_size=16)
    assert len(csv_data(path, "y", batch_size=8).train) == 8


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("a;b;y\n1;2;3\n4;5;6\n", r"semicolon-separated.*3 columns on ';'.*sep=';'\)"),
        ("a;b;y\n1,5;2,0;3,1\n4,5;5,1;6,2\n", r"semicolon-separated.*sep=';', decimal=','"),
        ("a\tb\ty\n1\t2\t3\n4\t5\t6\n", r"tab-separated.*3 columns"),
        ("a|b|y\n1|2|3\n4|5|6\n", r"pipe-separated"),
    ],
)
def test_csv_other_separators_are_named_with_the_fix(
    tmp_path: Path, text: str, named: str
) -> None:
    with pytest.raises(DataError, match=named) as error:
        csv_data(write(tmp_path, text), "y")
    assert "encode categories" not in str(error.value)
    assert "read_csv" in str(error.value)


@pytest.mark.parametrize("header", ["a,y,y", "y,a,y", "a,a,y"])
def test_csv_duplicated_column_names_are_refused(tmp_path: Path, header: str) -> None:
    rows = "".join(f"{i},{i + 1},{i + 2}\n" for i in range(20))
    with pytest.raises(DataError, match=r"appears twice \([A-C] and [A-C]\)"):
        csv_data(write(tmp_path, header + "\n" + rows), "y")


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ('a,b,y\n1,2,3\n"4,5,6\n7,8,9\n10,11,12\n', r"row 3, column 'a' \(A\): a quote"),
        ('a,b,y\n1,2,3\n4,5,6\n7,"8,9\n10,11,12\n', r"row 4, column 'b' \(B\): a quote"),
        ('a,b,y\n1,2,3\n4,5,"6\n7,8,9\n', r"row 3, column 'y' \(C\): a quote"),
    ],
)
def test_csv_open_quote_is_reported_where_it_opens(tmp_path: Path, text: str, where: str) -> None:
    with pytest.raises(DataError, match=where):
        csv_data(write(tmp_path, text), "y")


def test_csv_values_are_float32_and_match_the_cell_by_cell_reader(tmp_path: Path) -> None:
    from torchgpu.data.csv import _slow_values, read_numeric_csv

    rng = np.random.default_rng(0)
    table = rng.normal(size=(300, 4)) * 1e3
    text = "a,b,c,y\n" + "".join(",".join(f"{v:.6g}" for v in row) + "\n" for row in table)
    path = write(tmp_path, text.replace("\n", "\n\n", 3) + '"1",2, 3 ,4\n')
    names, values = read_numeric_csv(path)
    assert names == ("a", "b", "c", "y") and values.dtype == np.float32
    assert values.shape == (301, 4)
    np.testing.assert_array_equal(values, _slow_values(path, names))
    np.testing.assert_array_equal(values[-1], [1, 2, 3, 4])


def test_csv_unusual_but_valid_cells_still_read(tmp_path: Path) -> None:
    from torchgpu.data.csv import read_numeric_csv

    # Whitespace-only lines and underscores in numbers: not for numpy's reader, fine for
    # Python's float(); the cell-by-cell reader takes them.
    _, values = read_numeric_csv(write(tmp_path, "a,y\n1_000,2\n   \n3,4\n"))
    np.testing.assert_array_equal(values, [[1000, 2], [3, 4]])


def test_csv_beyond_float32_is_named(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"row 3, column 'a' \(A\) holds '1e39', beyond float32"):
        csv_data(write(tmp_path, "a,y\n1,2\n1e39,3\n4,5\n"), "y")


def test_handoff_round_trip_is_exact(tmp_path: Path) -> None:
    from torchgpu.data.handoff import load_example, save_example

    rows = "".join(f"{i},{i * 0.5},{i % 7}\n" for i in range(50))
    data = csv_data(write(tmp_path, "a,b,y\n" + rows), "y", seed=3)
    key = {"path": "table.csv", "size": 1, "seed": 3}
    save_example(data, tmp_path / "d.npz", key=key)
    back = load_example(tmp_path / "d.npz", expected_key=key)
    assert back is not None
    for mine, theirs in zip((*data.train.tensors, *data.test.tensors),
                            (*back.train.tensors, *back.test.tensors), strict=True):
        assert torch.equal(mine, theirs)
    assert (back.feature_names, back.feature_mean, back.feature_std, back.description) == (
        data.feature_names, data.feature_mean, data.feature_std, data.description)
    assert load_example(tmp_path / "d.npz", expected_key={**key, "seed": 4}) is None
    assert load_example(tmp_path / "missing.npz", expected_key=key) is None


@pytest.mark.parametrize(
    ("index", "letter"),
    [(0, "A"), (1, "B"), (25, "Z"), (26, "AA"), (27, "AB"), (701, "ZZ"), (702, "AAA")],
)
def test_column_letters(index: int, letter: str) -> None:
    assert column_letter(index) == letter


# ---------------------------------------------------------------- images


def test_lenet_images_shapes_and_determinism() -> None:
    data = example_data("lenet")
    x, y = data.train.tensors
    assert x.shape == (2048, 1, 28, 28) and len(data.test) == 512
    assert y.dtype == torch.int64 and set(y.unique().tolist()) == set(range(10))
    assert data.task == "classification" and data.num_outputs == 10
    assert torch.equal(example_data("lenet", size=100).train.tensors[0],
                       example_data("lenet", size=100).train.tensors[0])  # fmt: skip
    assert not torch.equal(example_data("lenet", seed=1, size=100).train.tensors[0],
                           example_data("lenet", size=100).train.tensors[0])  # fmt: skip


def test_lenet_images_carry_a_learnable_signal() -> None:
    data = example_data("lenet", size=640)
    torch.manual_seed(0)
    model = LeNet5()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    x_test, y_test = data.test.tensors
    with torch.no_grad():
        start = torch.nn.functional.cross_entropy(model(x_test), y_test).item()
    for _ in range(3):
        for x, y in make_loader(data.train, 32, shuffle=True, seed=0):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        out = model(x_test)
    end = torch.nn.functional.cross_entropy(out, y_test).item()
    accuracy = (out.argmax(1) == y_test).float().mean().item()
    assert end < 0.5 * start, (start, end)
    assert accuracy > 0.5  # chance is 0.1


def test_resnet50_images_as_the_seed() -> None:
    data = example_data("resnet50")
    x, y = data.train.tensors
    assert x.shape == (48, 3, 128, 128) and len(data.test) == 24
    assert data.num_outputs == 1000 and int(y.max()) < 1000
    small = example_data("resnet50", size=6, num_classes=10)
    assert small.num_outputs == 10 and int(small.train.tensors[1].max()) < 10


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_too_small_sizes_are_refused(name: str) -> None:
    with pytest.raises(DataError, match=r"size=1|1 rows"):
        example_data(name, size=1)


def test_unknown_example() -> None:
    with pytest.raises(DataError, match=r"'mnist'.*housing, lenet, resnet50"):
        example_data("mnist")


# ---------------------------------------------------------------- make_loader


def numbers(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def order(loader: torch.utils.data.DataLoader) -> list[int]:  # type: ignore[type-arg]
    return [int(v) for (batch,) in loader for v in batch]


def test_loader_in_order_and_seeded_shuffle() -> None:
    assert order(make_loader(numbers(10), 4)) == list(range(10))
    a = make_loader(numbers(50), 8, shuffle=True, seed=3)
    b = make_loader(numbers(50), 8, shuffle=True, seed=3)
    c = make_loader(numbers(50), 8, shuffle=True, seed=4)
    first = order(a)
    assert first == order(b) and first != order(c) and sorted(first) == list(range(50))
    assert order(a) != first  # the next epoch draws a new order from the same generator


def test_loader_does_not_touch_the_global_rng() -> None:
    torch.manual_seed(0)
    expected = torch.rand(1)
    torch.manual_seed(0)
    order(make_loader(numbers(20), 4, shuffle=True, seed=1))
    assert torch.equal(torch.rand(1), expected)


def test_loader_shards_across_ranks_and_set_epoch_reshuffles() -> None:
    loaders = [make_loader(numbers(10), 2, shuffle=True, seed=0, dist=Rank(r, 2)) for r in (0, 1)]
    shards = [order(loader) for loader in loaders]
    assert len(shards[0]) == len(shards[1]) == 5
    assert sorted(shards[0] + shards[1]) == list(range(10))
    assert order(loaders[0]) == shards[0]  # same epoch, same order
    set_epoch(loaders[0], 1)
    assert order(loaders[0]) != shards[0]
    single = make_loader(numbers(10), 2, dist=Rank(0, 1, is_distributed=False))
    assert order(single) == list(range(10))


def test_loader_pins_only_for_cuda() -> None:
    assert make_loader(numbers(4), 2, device="cpu").pin_memory is False
    assert make_loader(numbers(4), 2, device=torch.device("cuda", 0)).pin_memory is True
    assert make_loader(numbers(4), 2).pin_memory is False
    assert not torch.cuda.is_initialized()


def test_loader_errors() -> None:
    with pytest.raises(DataError, match="batch_size=0"):
        make_loader(numbers(4), 0)
    with pytest.raises(DataError, match="empty"):
        make_loader(numbers(0), 2)
    with pytest.raises(DataError, match=r"10 samples give 5 per rank \(2 ranks\).*batch of 8"):
        make_loader(numbers(10), 8, dist=Rank(0, 2), drop_last=True)
    assert len(make_loader(numbers(10), 8, drop_last=True)) == 1


def test_workers_load_the_launchers_data_instead_of_parsing_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    import torchgpu.data.csv as csv_module
    from torchgpu.examples import table
    from torchgpu.train.config import TrainConfig, resolve

    rows = "".join(f"{i},{i * 0.5},{i % 7}\n" for i in range(60))
    path = write(tmp_path, "a,b,y\n" + rows)
    config = resolve(TrainConfig(data=str(path), target="y", out=str(tmp_path / "out")))
    data = table.load(config)
    monkeypatch.delenv(table.HANDOFF_ENV, raising=False)
    with table.data_handoff(config, data):
        handed = os.environ[table.HANDOFF_ENV]
        parsed: list[object] = []
        real = csv_module.read_numeric_csv
        monkeypatch.setattr(csv_module, "read_numeric_csv",
                            lambda *a: parsed.append(a) or real(*a))
        again = table.load(config)  # what a worker does
        assert parsed == []
        assert torch.equal(again.train.tensors[0], data.train.tensors[0])
        assert torch.equal(again.test.tensors[1], data.test.tensors[1])
        # Another seed (or an edited file) is not what was handed off: parsed again.
        table.load(resolve(TrainConfig(data=str(path), target="y", seed=1,
                                            out=str(tmp_path / "out"))))
        assert len(parsed) == 1
    assert table.HANDOFF_ENV not in os.environ
    assert not Path(handed).exists()


@pytest.mark.parametrize(("rank_world", "shuffle", "drop_last", "workers"), [
    (None, True, False, 0), (None, False, False, 0), (None, True, True, 0),
    (None, True, False, 2), ((0, 3), True, False, 0), ((2, 3), True, False, 0),
    ((2, 3), False, False, 2),
])
def test_tensor_datasets_are_read_a_batch_at_a_time_with_the_same_batches(
        rank_world: tuple[int, int] | None, shuffle: bool, drop_last: bool,
        workers: int) -> None:
    from torch.utils.data import Dataset, TensorDataset

    from torchgpu.data.loader import batch_sampler_of
    from torchgpu.train.strategies.shard import Shard

    class RowByRow(Dataset[tuple[torch.Tensor, torch.Tensor]]):  # the same rows, one at a time
        def __init__(self, inner: TensorDataset) -> None:
            self.inner = inner

        def __len__(self) -> int:
            return len(self.inner)

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            x, y = self.inner[i]
            return x, y

    g = torch.Generator().manual_seed(5)
    # 25 rows on 3 ranks in batches of 8: the last global batch (1 row) leaves ranks 1
    # and 2 an empty share.
    data = TensorDataset(torch.randn(25, 3, generator=g), torch.randint(0, 4, (25,), generator=g))
    dist = Shard(*rank_world) if rank_world else None
    options: dict[str, Any] = dict(shuffle=shuffle, seed=3, dist=dist, pad=False,
                                   drop_last=drop_last, num_workers=workers)
    fast = make_loader(data, 8, **options)
    slow = make_loader(RowByRow(data), 8, **options)
    assert fast.batch_sampler is None and slow.batch_sampler is not None  # whole batches
    for epoch in (0, 1):
        set_epoch(fast, epoch)
        set_epoch(slow, epoch)
        got, want = list(fast), list(slow)
        assert len(got) == len(want) == len(fast) == len(slow)
        for (a, b), (c, d) in zip(got, want, strict=True):
            assert torch.equal(a, c) and torch.equal(b, d) and a.dtype == c.dtype
            assert a.is_contiguous()
    if rank_world == (2, 3):
        assert got[-1][0].shape[0] == 0  # an empty share, as the row-by-row loader gives
    layout = getattr(batch_sampler_of(fast), "layout", None)
    assert (layout is not None) == bool(rank_world)


def test_a_tensor_dataset_with_its_own_batched_fetch_keeps_it() -> None:
    from torch.utils.data import TensorDataset

    class Batched(TensorDataset):
        def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, ...]]:
            return [(torch.full((2,), 100.0), torch.tensor(0)) for _ in indices]

    loader = make_loader(Batched(torch.zeros(6, 2), torch.zeros(6)), 3)
    assert float(next(iter(loader))[0].max()) == 100.0
