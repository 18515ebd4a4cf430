"""torchgpu: PyTorch training that is correct and fast on whatever devices a machine has.

The public API is the import block under ``if TYPE_CHECKING`` below, written once: the
type checker reads it as it is, and at run time :func:`_public_names` reads the same
block from this file to build ``__all__`` and the table that resolves each name on
first use (PEP 562), so ``import torchgpu`` stays cheap and never initialises CUDA.

More lives in the submodules, documented there: ``torchgpu.devices`` (``DeviceInfo``,
``parse_visible_devices``, ``default_device``), ``torchgpu.transfer`` (``pin``),
``torchgpu.distributed`` (``DistEnv``), ``torchgpu.checkpoint`` (inspect, verify,
convert), ``torchgpu.memory`` (estimates, batch-size search, OOM back-off, activation
checkpointing), ``torchgpu.parallel.*`` and ``torchgpu.train``.
"""

from __future__ import annotations

import importlib
import re
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # the public API, one name per line (read by _public_names)
    from torchgpu.accumulate import GradAccumulator as GradAccumulator
    from torchgpu.checkpoint import load_checkpoint as load_checkpoint
    from torchgpu.checkpoint import load_state_dict as load_state_dict
    from torchgpu.checkpoint import save_checkpoint as save_checkpoint
    from torchgpu.devices import get_device as get_device
    from torchgpu.devices import list_devices as list_devices
    from torchgpu.devices import select_devices as select_devices
    from torchgpu.devices import set_visible_devices as set_visible_devices
    from torchgpu.distributed import init_distributed as init_distributed
    from torchgpu.memory import apply_activation_checkpointing as apply_activation_checkpointing
    from torchgpu.memory.estimate import estimate_memory as estimate_memory
    from torchgpu.parallel.data import unwrap as unwrap
    from torchgpu.parallel.data import wrap_data_parallel as wrap_data_parallel
    from torchgpu.parallel.model import split_model as split_model
    from torchgpu.parallel.pipeline import Pipeline as Pipeline
    from torchgpu.precision import Precision as Precision
    from torchgpu.train.fit import fit as fit
    from torchgpu.transfer import Prefetcher as Prefetcher
    from torchgpu.transfer import check_devices as check_devices
    from torchgpu.transfer import to_device as to_device


def _public_names() -> dict[str, str]:
    """``{name: defining module}`` from the ``if TYPE_CHECKING`` block of this file.

    A line scan (not ``ast``, whose import would cost more than the rest of this module):
    the block's lines all have the form ``from MODULE import NAME as NAME``.
    """
    line = re.compile(r"    from ([\w.]+) import (\w+) as \2\n")
    table: dict[str, str] = {}
    with open(__file__, encoding="utf-8") as source:
        for text in source:
            if text.startswith("if TYPE_CHECKING:"):
                break
        for text in source:
            found = line.fullmatch(text)
            if found is None:
                break
            table[found[2]] = found[1]
    return table


_API: dict[str, str] = _public_names()
__all__ = sorted([*_API, "__version__"])


def __getattr__(name: str) -> Any:
    module_name = _API.get(name)
    if module_name is None:
        raise AttributeError(f"module 'torchgpu' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return list(__all__)
