"""Load any numeric CSV table for regression (``torchgpu train --data FILE --target COL``).

The first row names the columns; every other column is a feature. Features are
standardised with train-split statistics; the target keeps its units. Problems are
reported as :class:`DataError` naming the file, the row as a spreadsheet numbers it
(the header is row 1) and the column (name and spreadsheet letter).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np

from torchgpu.data.base import ExampleData
from torchgpu.data.tabular import regression_data, split_indices
from torchgpu.errors import DataError


def column_letter(index: int) -> str:
    """Spreadsheet letter of a 0-based column index: 0 -> A, 25 -> Z, 26 -> AA."""
    letters = ""
    index += 1
    while index > 0:
        index, rem = divmod(index - 1, 26)
        letters = chr(ord("A") + rem) + letters
    return letters


def _parse_cell(text: str, path: Path, row: int, name: str, col: int) -> float:
    where = f"{path}: row {row}, column {name!r} ({column_letter(col)})"
    cell = text.strip()
    if not cell:
        raise DataError(
            f"{where} is empty: every cell must hold a number; fill it in or delete the row"
        )
    try:
        value = float(cell)
    except ValueError:
        raise DataError(
            f"{where} holds {cell!r}, which is not a number: only numeric tables are "
            "supported; encode categories as numbers or drop the column"
        ) from None
    if not math.isfinite(value):
        raise DataError(
            f"{where} holds {cell!r} (not a finite number): NaN and infinite values cannot "
            "be trained on; fill the cell with a real value or delete the row"
        )
    return value


def read_numeric_csv(path: str | Path) -> tuple[tuple[str, ...], np.ndarray]:
    """``(column names, values (rows, columns) float64)`` of a CSV with a header row.

    Blank lines are skipped. Raises :class:`DataError` for a missing or unreadable file,
    no header or no data rows, a row with the wrong number of cells, and any empty,
    non-numeric, NaN or infinite cell.
    """
    file = Path(path)
    if not file.is_file():
        raise DataError(
            f"data file {str(file)!r} does not exist (or is not a file): pass the path of a "
            "CSV table with a header row, e.g. --data data/houses.csv"
        )
    rows: list[list[float]] = []
    try:
        with file.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            header = next((r for r in reader if any(c.strip() for c in r)), None)
            if header is None:
                raise DataError(
                    f"{file} is empty: a CSV table needs a header row naming the columns "
                    "and at least one data row"
                )
            names = tuple(c.strip() for c in header)
            for cells in reader:
                if not any(c.strip() for c in cells):
                    continue
                row = reader.line_num
                if len(cells) != len(names):
                    raise DataError(
                        f"{file}: row {row} has {len(cells)} cells but the header has "
                        f"{len(names)} columns ({', '.join(names)}): every row needs one "
                        "cell per column"
                    )
                pairs = enumerate(zip(cells, names, strict=True))
                rows.append([_parse_cell(c, file, row, n, i) for i, (c, n) in pairs])
    except UnicodeDecodeError as error:
        raise DataError(
            f"{file} is not UTF-8 text ({error.reason} at byte {error.start}): save it as "
            "a UTF-8 CSV"
        ) from None
    except csv.Error as error:
        raise DataError(f"{file} is not a readable CSV ({error}): check its quoting") from None
    if not rows:
        raise DataError(f"{file} has a header but no data rows: add rows to the table")
    return names, np.asarray(rows, dtype=np.float64)


def csv_data(
    path: str | Path,
    target: str,
    seed: int = 0,
    test_fraction: float = 0.2,
    *,
    batch_size: int | None = None,
) -> ExampleData:
    """A regression :class:`ExampleData` from the CSV table at ``path``.

    ``target`` names the column to predict; all other columns are features, standardised
    with the train split's mean and std. The split is a seeded permutation
    (``seed``) keeping ``test_fraction`` of the rows for testing (at least 2 rows, so
    R² is defined). With ``batch_size``, the train split must hold at least one full
    batch.
    Raises :class:`DataError` (see :func:`read_numeric_csv`), also for a missing target
    column (the message lists the columns) and too few rows.
    """
    file = Path(path)
    names, values = read_numeric_csv(file)
    if target not in names:
        raise DataError(
            f"{file} has no column {target!r}: its columns are {', '.join(names)}; pass one "
            "of them with --target"
        )
    if len(names) < 2:
        raise DataError(
            f"{file} has only the target column {target!r}: add at least one feature column"
        )
    t = names.index(target)
    features = np.delete(values, t, axis=1)
    feature_names = tuple(n for i, n in enumerate(names) if i != t)
    train_idx, test_idx = split_indices(len(values), test_fraction, seed)
    n_train = len(train_idx)
    if batch_size is not None and n_train < batch_size:
        raise DataError(
            f"{file} has {len(values)} data rows, so the train split holds {n_train} rows "
            f"(test fraction {test_fraction}), fewer than one batch of {batch_size}: use "
            f"--batch-size {n_train} or less, or add rows"
        )
    if len(test_idx) < 2:
        needed = next(n for n in range(len(values), 10**6) if round(n * test_fraction) >= 2)
        raise DataError(
            f"{file} has {len(values)} data rows, so the test split holds {len(test_idx)} "
            f"row (test fraction {test_fraction}): R² is undefined on one row; add rows "
            f"(at least {needed})"
        )
    return regression_data(
        features,
        values[:, t],
        feature_names=feature_names,
        target_name=target,
        seed=seed,
        test_fraction=test_fraction,
        description=f"{file.name}: {len(values)} rows x {len(feature_names)} features, "
        f"target {target}",
    )
