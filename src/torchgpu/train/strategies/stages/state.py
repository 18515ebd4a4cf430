"""The multi-process stage pipeline's state in one place: rank 0 gathers, each rank restores.

Each process trains only its stages (layers of its own full model object) with an optimizer
over their parameters, while a checkpoint and ``model.safetensors`` are rank 0's files. So
before each save :func:`gather_weights` copies every rank's stage weights into rank 0's
model (the whole model under the plain model's keys), and :class:`StageOptimizers` gathers
the optimizer states keyed by parameter name, not by rank or position. A resume loads the
whole model on every rank and each rank picks its own parameters' optimizer entries; keyed
by parameter, the state fits any cut of the same model, so a resume may balance the stages
differently and continue exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

FORMAT = "torchgpu.stage-optimizers/1"


def _to_cpu(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().to("cpu")
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _gather_to_rank0(value: Any) -> list[Any]:
    """Every rank's ``value`` on rank 0 (rank order), an empty list elsewhere."""
    rank = dist.get_rank()
    out: list[Any] = [None] * dist.get_world_size() if rank == 0 else []
    dist.gather_object(value, out if rank == 0 else None, dst=0)
    return out


def owned_state(model: nn.Module, modules: Iterable[nn.Module]) -> dict[str, Tensor]:
    """The entries of ``model.state_dict`` (keep_vars: the live tensors) that belong to
    ``modules`` (this rank's stages), under the model's keys."""
    own = {id(t) for m in modules for t in (*m.parameters(), *m.buffers())}
    return {k: v for k, v in model.state_dict(keep_vars=True).items()
            if isinstance(v, Tensor) and id(v) in own}


def gather_weights(model: nn.Module, modules: Iterable[nn.Module]) -> None:
    """Copy every rank's stage weights and buffers into rank 0's ``model`` (collective:
    every rank calls it). Rank 0's own stages are current already; the other ranks send
    theirs (on the CPU), which rank 0 copies in place."""
    mine = owned_state(model, modules)
    sent = {} if dist.get_rank() == 0 else {k: _to_cpu(v) for k, v in mine.items()}
    gathered = _gather_to_rank0(sent)
    if not gathered:
        return
    targets = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for part in gathered:
            for key, value in part.items():
                targets[key].copy_(value)


class StageOptimizers:
    """The stages' optimizer states as one checkpoint entry (``optimizer=`` of
    :func:`torchgpu.checkpoint.save_checkpoint` / ``load_checkpoint``).

    :meth:`gather` (every rank, before a save) collects every rank's state on rank 0;
    ``state_dict`` (rank 0) returns it: ``{"format", "params": {key: {"group": the
    hyperparameters of the parameter's group, "state": its state}}}``, ``key`` being the
    parameter's key in the model's state dict. ``load_state_dict`` (every rank)
    restores the rank's own parameters' entries into its optimizer.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module,
                 modules: Iterable[nn.Module]) -> None:
        self.optimizer = optimizer
        key_of: dict[int, str] = {}
        for key, value in owned_state(model, modules).items():
            key_of.setdefault(id(value), key)  # a tied tensor: its first key
        # The optimizer's state_dict numbers its parameters in param_groups order.
        params = [p for group in optimizer.param_groups for p in group["params"]]
        missing = [i for i, p in enumerate(params) if id(p) not in key_of]
        if missing:
            raise ValueError(
                f"the stage optimizer holds {len(missing)} parameter(s) that are not in this "
                "rank's stages; build it over the stages' parameters only")
        self.keys = [key_of[id(p)] for p in params]
        self._gathered: dict[str, Any] | None = None

    def _local(self) -> dict[str, Any]:
        saved = self.optimizer.state_dict()
        entries: dict[str, Any] = {}
        for group in saved["param_groups"]:
            hyper = {k: v for k, v in group.items() if k != "params"}
            for index in group["params"]:
                entries[self.keys[index]] = {"group": _to_cpu(hyper),
                                             "state": _to_cpu(saved["state"].get(index, {}))}
        return entries

    def gather(self) -> None:
        """Collect every rank's entries on rank 0 (collective: every rank calls it)."""
        merged: dict[str, Any] = {}
        for part in _gather_to_rank0(self._local()):
            merged.update(part)
        self._gathered = {"format": FORMAT, "params": merged} if merged else None

    def state_dict(self) -> dict[str, Any]:
        """The whole pipeline's optimizer state (rank 0, after :meth:`gather`)."""
        if self._gathered is None:
            raise RuntimeError("StageOptimizers.state_dict() before gather() on rank 0")
        return self._gathered

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Restore this rank's parameters' entries. ValueError when ``saved`` is not a
        stage pipeline's optimizer state or lacks one of this rank's parameters."""
        if not isinstance(saved, Mapping) or saved.get("format") != FORMAT:
            raise ValueError(
                "it is not the optimizer state of a multi-process stage pipeline (saved by "
                "another strategy?); resume with the strategy that saved it")
        params = saved["params"]
        lacking = [key for key in self.keys if key not in params]
        if lacking:
            raise ValueError(
                f"it holds no optimizer state for {', '.join(lacking[:3])}"
                f"{' ...' if len(lacking) > 3 else ''}: it was saved for another model")
        current = self.optimizer.state_dict()
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        for group in current["param_groups"]:
            indices = list(group["params"])
            for index in indices:
                if params[self.keys[index]]["state"]:
                    state[index] = params[self.keys[index]]["state"]
            hyper = params[self.keys[indices[0]]]["group"] if indices else {}
            groups.append({**group, **hyper, "params": indices})
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
