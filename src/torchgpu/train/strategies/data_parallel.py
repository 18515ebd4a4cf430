"""``--strategy dp|ddp|fsdp``: data parallelism (one replica or shard per device).

``dp`` is ``nn.DataParallel`` in one process over every visible GPU (it falls back to
one device with a note); ``ddp`` and ``fsdp`` run one process per device
(``--nproc``) through :func:`torchgpu.parallel.data.wrap_data_parallel`, and in one
process train as ``single`` (nothing to synchronise).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from torchgpu.train.strategies.base import Features, Strategy
from torchgpu.train.strategies.single import SINGLE

if TYPE_CHECKING:
    # torch and torchgpu.parallel only here and inside methods (see strategies.base)
    import torch
    from torch import Tensor, nn

    from torchgpu.train.config import TrainConfig
    from torchgpu.train.task import Task


class DataParallel(Strategy):
    """``nn.DataParallel``: one process scatters each batch over the visible GPUs."""

    name = "dp"
    help = "nn.DataParallel over the visible GPUs, one process"
    processes = "one"
    features = Features()

    def wrap(self, model: nn.Module, config: TrainConfig, task: Task,
             device: torch.device) -> tuple[nn.Module, tuple[str, ...]]:
        from torchgpu.parallel.data import wrap_data_parallel

        # wrap_data_parallel warns when it falls back to one device: shown as a note.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wrapped = wrap_data_parallel(model, "dp", device=device,
                                         batch_size=config.batch_size)
        notes = tuple(f"note: {w.message}" for w in caught)
        if wrapped is model:
            model.to(device)  # in place; a model's own .to() override may return nothing
        return wrapped, notes


class Ddp(Strategy):
    """DistributedDataParallel: one process per device, gradients all-reduced."""

    name = "ddp"
    help = "DistributedDataParallel, one process per device (--nproc)"
    processes = "several"
    features = Features(estimate="ddp")

    def alone(self) -> Strategy:
        return SINGLE

    def wrap(self, model: nn.Module, config: TrainConfig, task: Task,
             device: torch.device) -> tuple[nn.Module, tuple[str, ...]]:
        from torchgpu.parallel.data import wrap_data_parallel

        model.to(device)  # in place; a model's own .to() override may return nothing
        return wrap_data_parallel(model, self.name, device=device), ()


class Fsdp(Ddp):
    """FSDP2 (``fully_shard``): parameters, gradients and optimizer state sharded; its
    checkpoints are sharded too (:mod:`torchgpu.checkpoint.sharded`)."""

    name = "fsdp"
    help = "fully sharded data parallel (FSDP2), one process per device (--nproc)"
    features = Features(
        backoff="it reduce-scatters inside every backward, so a smaller retry cannot be "
                "agreed on",
        auto_batch="its probes would run the sharded collectives, which hang when one rank "
                   "runs out of memory; pass --batch-size B, or use --strategy ddp",
        estimate="fsdp", sharded_checkpoints=True)

    def full_state(self, model: nn.Module) -> dict[str, Tensor]:
        """The full (gathered) state: collective, every rank calls it."""
        from torch import Tensor
        from torch.distributed.checkpoint.state_dict import (  # heavy: only for fsdp runs
            StateDictOptions,
            get_model_state_dict,
        )

        from torchgpu.parallel.data import retie

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state: dict[str, Any] = dict(get_model_state_dict(model, options=options))
        full = {k: v.detach() for k, v in state.items() if isinstance(v, Tensor)}
        return retie(full, model)  # each name was gathered on its own: keep ties single

    def eval_model(self, model: nn.Module) -> nn.Module:
        # The sharded module gathers its parameters in forward: evaluate through it.
        return model


DP = DataParallel()
DDP = Ddp()
FSDP = Fsdp()
