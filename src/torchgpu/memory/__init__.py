"""Device memory during training: estimate it, search for what fits, recover when it runs out,
and trade compute for it.

One concept per module:

- :mod:`~torchgpu.memory.estimate`: per-device training memory for a model, batch and
  strategy, before anything runs (:func:`estimate_memory`);
- :mod:`~torchgpu.memory.batch_size_search`: the largest micro-batch that fits
  (:func:`find_batch_size`), and the effective batch kept with accumulation;
- :mod:`~torchgpu.memory.oom`: recognising out-of-memory errors (:func:`is_oom`),
  releasing a failed step, and the back-off that halves the micro-batch
  (:class:`OOMBackoff`);
- :mod:`~torchgpu.memory.activation_checkpointing`: recompute activations in backward
  instead of keeping them (:func:`apply_activation_checkpointing`);
- :mod:`~torchgpu.memory.repeated_blocks`: a model's repeated block, what is
  checkpointed (:func:`find_repeated_blocks`);
- :mod:`~torchgpu.memory.saved_tensors`: what autograd keeps for backward, measured
  (:func:`saved_tensor_bytes`).

The names below are resolved on first use (PEP 562), so ``import torchgpu.memory`` loads
nothing else.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> module that defines it.
_EXPORTS: dict[str, str] = {
    "MemoryEstimate": "torchgpu.memory.estimate.estimator",
    "estimate_memory": "torchgpu.memory.estimate.estimator",
    "find_batch_size": "torchgpu.memory.batch_size_search",
    "keep_effective": "torchgpu.memory.batch_size_search",
    "OOMBackoff": "torchgpu.memory.oom",
    "is_oom": "torchgpu.memory.oom",
    "apply_activation_checkpointing": "torchgpu.memory.activation_checkpointing",
    "checkpointing_report": "torchgpu.memory.activation_checkpointing",
    "remove_activation_checkpointing": "torchgpu.memory.activation_checkpointing",
    "find_repeated_blocks": "torchgpu.memory.repeated_blocks",
    "saved_tensor_bytes": "torchgpu.memory.saved_tensors",
}

__all__ = [
    "MemoryEstimate",
    "OOMBackoff",
    "apply_activation_checkpointing",
    "checkpointing_report",
    "estimate_memory",
    "find_batch_size",
    "find_repeated_blocks",
    "is_oom",
    "keep_effective",
    "remove_activation_checkpointing",
    "saved_tensor_bytes",
]


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'torchgpu.memory' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(__all__) | set(globals()))


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from torchgpu.memory.activation_checkpointing import (
        apply_activation_checkpointing,
        checkpointing_report,
        remove_activation_checkpointing,
    )
    from torchgpu.memory.batch_size_search import find_batch_size, keep_effective
    from torchgpu.memory.estimate.estimator import MemoryEstimate, estimate_memory
    from torchgpu.memory.oom import OOMBackoff, is_oom
    from torchgpu.memory.repeated_blocks import find_repeated_blocks
    from torchgpu.memory.saved_tensors import saved_tensor_bytes
