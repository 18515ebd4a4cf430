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

from typing import TYPE_CHECKING

from torchgpu._lazy import exports

if TYPE_CHECKING:  # the exports, one name per line (read by torchgpu._lazy)
    from torchgpu.memory.activation_checkpointing import (
        apply_activation_checkpointing as apply_activation_checkpointing,
    )
    from torchgpu.memory.activation_checkpointing import (
        checkpointing_report as checkpointing_report,
    )
    from torchgpu.memory.activation_checkpointing import (
        remove_activation_checkpointing as remove_activation_checkpointing,
    )
    from torchgpu.memory.batch_size_search import find_batch_size as find_batch_size
    from torchgpu.memory.batch_size_search import keep_effective as keep_effective
    from torchgpu.memory.estimate.estimator import estimate_memory as estimate_memory
    from torchgpu.memory.estimate.result import MemoryEstimate as MemoryEstimate
    from torchgpu.memory.oom import OOMBackoff as OOMBackoff
    from torchgpu.memory.oom import is_oom as is_oom
    from torchgpu.memory.repeated_blocks import find_repeated_blocks as find_repeated_blocks
    from torchgpu.memory.saved_tensors import saved_tensor_bytes as saved_tensor_bytes
else:
    __getattr__, __dir__, __all__ = exports(__name__, __file__)
