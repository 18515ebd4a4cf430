"""The curated public API: every name in ``torchgpu.__all__`` resolves lazily, and the
lazy table and ``__all__`` list the same names."""

from __future__ import annotations

import subprocess
import sys

import torchgpu
from tests.procs import test_env


def test_all_matches_the_lazy_table() -> None:
    assert set(torchgpu.__all__) - {"__version__"} == set(torchgpu._API)


def test_every_public_name_resolves() -> None:
    for name in torchgpu.__all__:
        assert getattr(torchgpu, name) is not None, name


def test_unknown_name_raises_attribute_error() -> None:
    try:
        torchgpu.no_such_thing  # noqa: B018
    except AttributeError as error:
        assert "no_such_thing" in str(error)
    else:  # pragma: no cover
        raise AssertionError("expected AttributeError")


def test_resolving_the_whole_api_does_not_start_cuda() -> None:
    code = (
        "import torch, torchgpu\n"
        "[getattr(torchgpu, n) for n in torchgpu.__all__]\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=test_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
