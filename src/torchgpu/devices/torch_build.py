"""Which torch is installed, and what it was built for, read without importing torch.

Importing torch takes about a second (far more on a cold disk); ``torchgpu devices``,
``select`` and ``env`` only need to know torch's version and whether it is a CUDA, ROCm
or CPU-only build. Those facts are literals in the installed ``torch/version.py``,
written when the wheel was built, so they are read from that file with :mod:`ast`.
Once torch is imported its own ``torch.version`` answers instead (the same values;
tests replace them there to stand in for other builds).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TorchBuild:
    """torch's ``__version__``, ``version.cuda`` and ``version.hip`` (None: not built for it)."""

    version: str
    cuda: str | None
    hip: str | None

    @property
    def cpu_only(self) -> bool:
        """True for a build with neither CUDA nor ROCm: torch sees no GPU at all."""
        return self.cuda is None and self.hip is None


def torch_loaded() -> bool:
    """Whether this process has imported torch (then asking it costs nothing)."""
    return "torch" in sys.modules


def _from_torch() -> TorchBuild:
    import torch

    return TorchBuild(
        version=str(torch.__version__), cuda=torch.version.cuda, hip=torch.version.hip
    )


def _from_file(path: Path) -> TorchBuild | None:
    """The literals ``__version__``, ``cuda`` and ``hip`` assigned in ``version.py``."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    except (OSError, SyntaxError, ValueError):
        return None
    values: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name):
            with contextlib.suppress(ValueError):
                values[target.id] = ast.literal_eval(value)
    version, cuda, hip = values.get("__version__"), values.get("cuda"), values.get("hip")
    if not isinstance(version, str):
        return None
    if (cuda is None or isinstance(cuda, str)) and (hip is None or isinstance(hip, str)):
        return TorchBuild(version=version, cuda=cuda, hip=hip)
    return None


def torch_build() -> TorchBuild:
    """The installed torch's version and CUDA/ROCm build; never initialises CUDA.

    Without importing torch where ``torch/version.py`` can be read (the usual case);
    otherwise, or once torch is imported, from ``torch.version`` itself.
    """
    if torch_loaded():
        return _from_torch()
    spec = importlib.util.find_spec("torch")  # locates the package; imports nothing
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        found = _from_file(Path(location) / "version.py")
        if found is not None:
            return found
    return _from_torch()  # an unusual install: let torch say it


def mps_available() -> bool:
    """Whether Apple's Metal backend (``mps``) can be used: macOS only, so anywhere else
    the answer needs no torch; on macOS torch is asked."""
    if sys.platform != "darwin":
        return False
    import torch

    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())
