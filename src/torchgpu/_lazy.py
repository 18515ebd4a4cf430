"""Lazy package exports (PEP 562) from one list: the package's ``if TYPE_CHECKING:`` block.

A package's ``__init__`` lists what it exports once, as the type checker reads it::

    if TYPE_CHECKING:
        from torchgpu.devices.listing import list_devices as list_devices
    else:
        __getattr__, __dir__, __all__ = exports(__name__, __file__)

At run time :func:`exports` reads that block from the file (one line per name, the form
above) and resolves each name on first use, so importing the package loads none of its
submodules (and never torch where the names do not need it). The ``__getattr__`` stays
out of the type checker's sight, so a misspelt name is a type error, not ``Any``.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

_LINE = re.compile(r"    from ([\w.]+) import (\w+) as \2\n")
_OPEN = re.compile(r"    from ([\w.]+) import \(\n")  # a long line, wrapped by the formatter
_NAME = re.compile(r"        (\w+) as \1,\n")


def export_table(init_file: str) -> dict[str, str]:
    """``{name: defining module}`` from the ``if TYPE_CHECKING:`` block of ``init_file``.

    A line scan (not ``ast``, whose import would cost more than the rest of a small
    package) of lines ``from MODULE import NAME as NAME``, or that import wrapped in
    parentheses; the block ends at its first line of another form.
    """
    table: dict[str, str] = {}
    wrapped: str | None = None  # the module of an open parenthesised import
    with open(init_file, encoding="utf-8") as source:
        for text in source:
            if text.startswith("if TYPE_CHECKING:"):
                break
        for text in source:
            if wrapped is not None:
                name = _NAME.fullmatch(text)
                if name is not None:
                    table[name[1]] = wrapped
                    continue
                if text != "    )\n":
                    break
                wrapped = None
                continue
            found, opened = _LINE.fullmatch(text), _OPEN.fullmatch(text)
            if found is not None:
                table[found[2]] = found[1]
            elif opened is not None:
                wrapped = opened[1]
            else:
                break
    if not table:
        raise ImportError(f"{init_file}: no 'if TYPE_CHECKING:' export block was found")
    return table


def exports(package: str, init_file: str, *extra: str
            ) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` for ``package`` from its export block;
    ``extra`` names defined in the ``__init__`` itself join ``__all__``."""
    table = export_table(init_file)
    names = sorted([*table, *extra])

    def __getattr__(name: str) -> Any:
        module_name = table.get(name)
        if module_name is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module_name), name)
        setattr(importlib.import_module(package), name, value)  # resolved once
        return value

    def __dir__() -> list[str]:
        return list(names)

    return __getattr__, __dir__, names
