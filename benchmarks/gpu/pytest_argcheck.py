"""A pytest plugin for the kit's parse check (parsecheck.check_pytest): loaded with
``-p pytest_argcheck`` in front of a kit step's pytest arguments, it lets pytest parse
them with every plugin's options (xdist's -n/--dist, pytest-timeout's --timeout, the
repository's conftest and ini), prints what was parsed as one JSON line and ends before
any collection: a wrong flag or value exits 4 with pytest's own message."""

from __future__ import annotations

import json

import pytest

MARK = "KIT-PYTEST-ARGS:"


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> int:
    markexpr = config.getoption("markexpr", "") or ""
    problem = None
    if markexpr:
        try:  # pytest's own -m grammar (a private module: skipped if it moves)
            from _pytest.mark.expression import Expression
        except ImportError:
            pass
        else:
            try:
                Expression.compile(markexpr)
            except Exception as error:  # ParseError
                problem = f"-m {markexpr!r}: {error}"
    print(MARK + json.dumps({"args": list(config.args), "markexpr": markexpr,
                             "problem": problem}), flush=True)
    return 0
