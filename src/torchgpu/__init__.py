"""torchgpu: PyTorch training that is correct and fast on whatever devices a machine has.

The public API is the import block under ``if TYPE_CHECKING`` below, written once: the
type checker reads it as it is, and at run time :func:`torchgpu._lazy.exports` reads the
same block from this file to build ``__all__`` and resolve each name on first use
(PEP 562), so ``import torchgpu`` stays cheap and never initialises CUDA.

More lives in the submodules, documented there: ``torchgpu.devices`` (``DeviceInfo``,
``parse_visible_devices``, ``default_device``), ``torchgpu.transfer`` (``pin``),
``torchgpu.distributed`` (``DistEnv``), ``torchgpu.checkpoint`` (inspect, verify,
convert), ``torchgpu.memory`` (estimates, batch-size search, OOM back-off, activation
checkpointing), ``torchgpu.parallel.*`` and ``torchgpu.train``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchgpu._lazy import exports
from torchgpu.version import __version__ as __version__

if TYPE_CHECKING:  # the public API, one name per line (read by torchgpu._lazy)
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
else:
    __getattr__, __dir__, __all__ = exports(__name__, __file__, "__version__")
