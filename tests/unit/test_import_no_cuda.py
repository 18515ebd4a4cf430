"""Importing every torchgpu module, and using its read-only calls, never initialises
CUDA. In a child process, torch.cuda._lazy_init is replaced by a function that fails
loudly, so the check means something even on a CPU-only build of torch."""

from __future__ import annotations

import subprocess
import sys

from tests.procs import test_env as child_env


def _all_modules() -> list[str]:
    """Every module of the package (so a new module is checked without editing this list),
    except ``__main__``, which runs the CLI when imported."""
    import pkgutil

    import torchgpu

    names = ["torchgpu"]
    for info in pkgutil.walk_packages(torchgpu.__path__, "torchgpu."):
        if not info.name.endswith("__main__"):
            names.append(info.name)
    return names


MODULES = _all_modules()

CHILD = f"""
import contextlib, io, torch
def boom(*a, **k):
    raise SystemExit("CUDA was initialised")
torch.cuda._lazy_init = boom
import importlib
for name in {MODULES!r}:
    importlib.import_module(name)
import torchgpu
from torchgpu import devices
torchgpu.list_devices, torchgpu.get_device, torchgpu.to_device, torchgpu.check_devices
devices.list_devices(); devices.get_device("auto"); devices.cuda_unavailable_reason()
devices.parse_visible_devices("0,1")
from torchgpu.cli.main import main
with contextlib.redirect_stdout(io.StringIO()):
    for argv in (["env"], ["devices", "--json"], ["doctor"]):
        main(argv)
assert not torch.cuda.is_initialized()
print("ok")
"""


def test_import_and_queries_do_not_initialise_cuda():
    result = subprocess.run(
        [sys.executable, "-c", CHILD],
        capture_output=True,
        text=True,
        timeout=90,
        env=child_env(),
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"
