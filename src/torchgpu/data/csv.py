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
from typing import TextIO

import numpy as np

from torchgpu.data.base import ExampleData
from torchgpu.data.tabular import regression_data, split_indices
from torchgpu.errors import DataError
from torchgpu.user_files import check_file, reading


def column_letter(index: int) -> str:
    """Spreadsheet letter of a 0-based column index: 0 -> A, 25 -> Z, 26 -> AA."""
    letters = ""
    index += 1
    while index > 0:
        index, rem = divmod(index - 1, 26)
        letters = chr(ord("A") + rem) + letters
    return letters


_SEPARATORS = {";": "semicolon", "\t": "tab", "|": "pipe", " ": "space"}
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _where(path: Path, row: int, names: tuple[str, ...], col: int) -> str:
    return f"{path}: row {row}, column {names[col]!r} ({column_letter(col)})"


def _parse_cell(text: str, path: Path, row: int, names: tuple[str, ...], col: int) -> float:
    cell = text.strip()
    if not cell:
        raise DataError(
            f"{_where(path, row, names, col)} is empty: every cell must hold a number; fill "
            "it in or delete the row"
        )
    try:
        value = float(cell)
    except ValueError:
        raise DataError(
            f"{_where(path, row, names, col)} holds {cell!r}, which is not a number: only "
            "numeric tables are supported; encode categories as numbers or drop the column"
        ) from None
    if not math.isfinite(value):
        raise DataError(
            f"{_where(path, row, names, col)} holds {cell!r} (not a finite number): NaN and "
            "infinite values cannot be trained on; fill the cell with a real value or delete "
            "the row"
        )
    if abs(value) > _FLOAT32_MAX:
        raise DataError(
            f"{_where(path, row, names, col)} holds {cell!r}, beyond float32's range "
            f"(+-{_FLOAT32_MAX:.3g}) that training uses: rescale the column (e.g. its "
            "logarithm) or drop it"
        )
    return value


def likely_separator(lines: list[str]) -> str | None:
    """The separator ``lines`` (a header and the first rows) use if it is not a comma:
    one of ``;``, tab and ``|`` that occurs the same number of times (at least once) in
    every line, else spaces (``" "``) when every line splits on runs of whitespace into
    the same number (more than one) of fields. None when there is no such separator."""
    lines = [line.strip("\r\n") for line in lines if line.strip()]
    if not lines:
        return None
    for sep in _SEPARATORS:
        if sep == " ":
            counts = {len(line.split()) for line in lines}
            if len(counts) == 1 and counts.pop() > 1:
                return sep
            continue
        counts = {line.count(sep) for line in lines}
        if len(counts) == 1 and counts.pop() > 0:
            return sep
    return None


def _check_header(file: Path, names: tuple[str, ...], first_lines: list[str]) -> None:
    """Refuse a table read with the wrong separator, and duplicated column names."""
    sep = likely_separator(first_lines) if len(names) == 1 else None
    if sep is not None:
        label = _SEPARATORS[sep]
        shown = {"\t": "\\t", " ": "\\s+"}.get(sep, sep)
        columns = len(first_lines[0].split()) if sep == " " else first_lines[0].count(sep) + 1
        on = "runs of spaces" if sep == " " else f"'{shown}'"
        raw = "r" if sep == " " else ""
        decimal = ", decimal=','" if sep == ";" and any("," in x for x in first_lines[1:]) else ""
        raise DataError(
            f"{file} looks {label}-separated: its header splits into {columns} columns on "
            f"{on} but is one column when read as comma-separated CSV, the only kind "
            "torchgpu reads. Save it with commas, e.g. pandas.read_csv("
            f"{str(file)!r}, sep={raw}'{shown}'{decimal}).to_csv('table.csv', index=False), "
            "and pass that file"
        )
    seen: dict[str, int] = {}
    for col, name in enumerate(names):
        if name in seen:
            first = seen[name]
            raise DataError(
                f"{file}: column {name!r} appears twice ({column_letter(first)} and "
                f"{column_letter(col)}): every column needs its own name, or the same data "
                "could be both a feature and the target; rename or drop one of them"
            )
        seen[name] = col


def _fast_values(f: TextIO, n_columns: int) -> np.ndarray | None:
    """The rest of ``f`` as float32 rows through numpy's C reader, or None for anything
    it does not read exactly as :func:`_slow_values` would (the slow reader then finds
    and reports the problem, or reads the unusual-but-valid table)."""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "input contained no data": handled below
            values = np.loadtxt(f, delimiter=",", dtype=np.float32, comments=None,
                                quotechar='"', ndmin=2)
    except (ValueError, UnicodeDecodeError):
        return None
    if values.shape[0] == 0 or values.shape[1] != n_columns or not np.isfinite(values).all():
        return None
    return values


def _slow_values(file: Path, names: tuple[str, ...]) -> np.ndarray:
    """Every data row of ``file`` as float32, streamed cell by cell with exact errors.

    Rows are numbered where they start (a quote left open makes one record of many
    lines: the error names the row where it opened)."""
    from array import array

    cells_read = array("d")
    n_rows = 0
    with file.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        next((r for r in reader if any(c.strip() for c in r)), None)  # the header
        while True:
            start = reader.line_num + 1
            try:
                cells = next(reader)
            except StopIteration:
                break
            except csv.Error as error:
                raise DataError(
                    f"{file}: row {start} is not readable CSV ({error}): check its quoting"
                ) from None
            if not any(c.strip() for c in cells):
                continue
            if reader.line_num > start:
                _check_open_quote(file, start, reader.line_num, cells, names)
            if len(cells) != len(names):
                raise DataError(
                    f"{file}: row {start} has {len(cells)} cells but the header has "
                    f"{len(names)} columns ({', '.join(names)}): every row needs one "
                    "cell per column"
                )
            cells_read.extend(_parse_cell(c, file, start, names, i) for i, c in enumerate(cells))
            n_rows += 1
    if not n_rows:
        raise DataError(f"{file} has a header but no data rows: add rows to the table")
    return np.frombuffer(cells_read, dtype=np.float64).reshape(n_rows, len(names)).astype(
        np.float32
    )


def _check_open_quote(file: Path, start: int, end: int, cells: list[str],
                      names: tuple[str, ...]) -> None:
    """A record over several lines holds a quoted line break: in a numeric table that
    is a quote left open. Name the row and column where it opened."""
    col = next((i for i, c in enumerate(cells) if "\n" in c or "\r" in c), None)
    if col is None:
        return
    column = f"column {names[col]!r} ({column_letter(col)})" if col < len(names) else (
        f"cell {col + 1}")
    raise DataError(
        f"{file}: row {start}, {column}: a quote (\") opens there and is not closed on "
        f"that row, so rows {start}..{end} were read as one cell: close the quote or "
        "remove it"
    )


def read_numeric_csv(path: str | Path) -> tuple[tuple[str, ...], np.ndarray]:
    """``(column names, values (rows, columns) float32)`` of a CSV with a header row.

    Blank lines, and rows whose cells are all empty (a spreadsheet's empty rows), are
    skipped. Numbers are read by numpy's C reader; a table it does not
    take is read again cell by cell to report the first problem exactly. Raises
    :class:`DataError` for a missing or unreadable file, no header or no data rows, a
    table separated by ``;``, tab or ``|`` (named, with the fix), duplicated column
    names, a row with the wrong number of cells, a quote left open (at the row where
    it opens), and any empty, non-numeric, NaN, infinite or beyond-float32 cell.
    """
    fix = "Pass the path of a CSV table with a header row, e.g. --data data/houses.csv"
    file = check_file(path, what="data file", fix=fix, error=DataError)
    with reading(file, what="data file", fix=fix, error=DataError):
        return _read(file)


def _read(file: Path) -> tuple[tuple[str, ...], np.ndarray]:
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
            values = _fast_values(f, len(names))
        if len(names) == 1 or values is None:
            with file.open(newline="", encoding="utf-8-sig") as f:
                first_lines = [line for _, line in zip(range(6), f, strict=False)]
            _check_header(file, names, [x for x in first_lines if x.strip()])
        else:
            _check_header(file, names, [])
        if values is None:
            values = _slow_values(file, names)
    except UnicodeDecodeError as error:
        raise DataError(
            f"{file} is not UTF-8 text ({error.reason} at byte {error.start}): save it as "
            "a UTF-8 CSV"
        ) from None
    except csv.Error as error:
        raise DataError(f"{file} is not a readable CSV ({error}): check its quoting") from None
    return names, values


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
