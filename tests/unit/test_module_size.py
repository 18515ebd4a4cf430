"""No module of torchgpu passes :data:`LIMIT` lines: a module holds one concept, and one
that grows past the limit holds several (split it by concept, not by line count)."""

from __future__ import annotations

from pathlib import Path

import torchgpu

PACKAGE = Path(torchgpu.__file__).parent
LIMIT = 400


def test_no_module_over_the_limit() -> None:
    sizes = {file.relative_to(PACKAGE).as_posix(): len(file.read_text().splitlines())
             for file in PACKAGE.rglob("*.py")}
    assert "train/runner.py" in sizes  # the walk found the package
    over = sorted(f"{name}: {lines} lines" for name, lines in sizes.items()
                  if lines > LIMIT)
    assert not over, f"modules over {LIMIT} lines:\n" + "\n".join(over)
