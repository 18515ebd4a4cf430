"""``--model`` for the CLI verbs: a ``module:factory`` spec resolved to a callable.

Accepted forms: ``package.module:factory``, ``package.module:Class.builder`` (dotted
attributes) and ``path/to/file.py:factory``. The resolution itself is library code
(:mod:`torchgpu.factories`); this module only gives the verbs the factory they call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from torch import nn

from torchgpu.factories import resolve_callable


def resolve_factory(spec: str) -> Callable[[], nn.Module]:
    """The callable ``spec`` names. Raises UsageError (exit 2) for a malformed spec, a
    module or file that cannot be imported, a missing attribute or a non-callable one."""
    return cast(Callable[[], nn.Module], resolve_callable(spec, "model"))
