"""The final model of a run whose checkpoints are sharded (``--strategy fsdp``).

Below :func:`gather_limit` bytes of model state (default 2 GiB, or the environment
variable ``TORCHGPU_GATHER_LIMIT_BYTES``) the weights are gathered whole on rank 0 and
written as ``OUT/model.safetensors``, like every other strategy's. Above it nothing is
gathered: every rank writes its shards into ``OUT/model-shards/`` (a sharded checkpoint
directory holding the model alone, :mod:`torchgpu.checkpoint.sharded`), so no process
ever holds the whole model; ``torchgpu ckpt convert OUT/model-shards model.safetensors``
gathers it into one file on demand, and the loaders (``torchgpu.load_checkpoint``,
``load_state_dict``) read it as it is.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from torch import Tensor, nn

from torchgpu.errors import ConfigError
from torchgpu.train.outputs.files import MODEL_SHARDS_DIR

if TYPE_CHECKING:
    from torchgpu.checkpoint.sharded import ShardedSaver
    from torchgpu.train.state import TrainState

GATHER_LIMIT_ENV = "TORCHGPU_GATHER_LIMIT_BYTES"
GATHER_LIMIT_BYTES = 2 << 30


def gather_limit() -> int:
    """The largest model state (bytes) gathered whole for ``model.safetensors``."""
    raw = os.environ.get(GATHER_LIMIT_ENV, "").strip()
    if not raw:
        return GATHER_LIMIT_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(
            f"{GATHER_LIMIT_ENV}={raw!r} is not a number of bytes; set it to a whole number "
            f"(0: never gather the final model of an fsdp run) or unset it (default "
            f"{GATHER_LIMIT_BYTES})")
    return value


def state_bytes(model: nn.Module) -> int:
    """The bytes of ``model``'s whole state (parameters and buffers at their global
    size: a sharded parameter counts in full)."""
    total = 0
    for tensor in (*model.parameters(), *model.buffers()):
        total += tensor.numel() * tensor.element_size()  # a DTensor's numel is global
    return total


def final_weights(model: nn.Module, shards: ShardedSaver | None, out: Path,
                  state: TrainState, gather: Callable[[], dict[str, Tensor]]
                  ) -> dict[str, Tensor] | None:
    """The run's final weights for ``model.safetensors`` (``gather()``, collective), or
    ``None`` once every rank wrote them as ``out/model-shards`` (sharded checkpoints and
    a model above :func:`gather_limit`). Every rank calls it."""
    if shards is None or state_bytes(model) <= gather_limit():
        return gather()
    shards.save(out / MODEL_SHARDS_DIR, model=model, optimizer=None, step=state.step,
                epoch=state.epoch, meta={"final_model": True}, latest=False)
    shards.wait()
    return None
