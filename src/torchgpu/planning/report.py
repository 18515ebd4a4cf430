"""The plan as a JSON-ready document (``torchgpu plan --json``).

Schema 1 (new keys may be added; existing keys keep their meaning; bytes are ints;
``train_settings`` holds the TrainConfig fields the plan sets, as ``torchgpu train
--strategy auto`` applies them)::

    {
      "schema": 1,
      "workload": {"example": str | null, "model": str | null, "batch_size": int,
                   "optimizer": str, "precision": str},
      "headroom_fraction": float,          # of each device's memory left unused
      "devices": [{"name": str, "kind": str, "real": bool,
                   "memory_bytes": int, "usable_bytes": int}],
      "footprint": {"batch_size": int, "param_bytes": int, "grad_bytes": int,
                    "optimizer_bytes": int, "activation_bytes": int,
                    "checkpointed_activation_bytes": int, "transient_bytes": int,
                    "layers": int, "source": str},
      "strategies": [{"label": str, "strategy": str, "devices": [str],
                      "micro_batch": int, "accumulate": int, "effective_batch": int,
                      "activation_checkpointing": bool, "chunks": int | null,
                      "balance": [int] | null, "per_device_bytes": [int],
                      "usable_bytes": [int], "fits": bool, "applicable": bool,
                      "time_factor": float | null, "note": str}],
      "plan": {"strategy": str, "label": str, "micro_batch": int, "accumulate": int,
               "activation_checkpointing": bool, "devices": [str], "nproc": int,
               "chunks": int | null, "balance": [int] | null, "effective_batch": int,
               "reason": str, "command": str | null, "python": str | null,
               "train_settings": {str: str | int | bool}} | null,
      "error": str | null                  # why no plan (nothing fits)
    }
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torchgpu.planning.candidates import Candidate
from torchgpu.planning.decide import Plan
from torchgpu.planning.footprint import Footprint
from torchgpu.planning.targets import HEADROOM, DeviceTarget
from torchgpu.planning.workload import Workload

SCHEMA_VERSION = 1


def candidate_dict(c: Candidate) -> dict[str, object]:
    """One strategy row as JSON-ready values (``time_factor`` null when not applicable)."""
    return {
        "label": c.label,
        "strategy": c.strategy,
        "devices": list(c.devices),
        "micro_batch": c.micro_batch,
        "accumulate": c.accumulate,
        "effective_batch": c.effective_batch,
        "activation_checkpointing": c.checkpointing,
        "chunks": c.chunks,
        "balance": list(c.balance) if c.balance is not None else None,
        "per_device_bytes": list(c.per_device_bytes),
        "usable_bytes": list(c.usable_bytes),
        "fits": c.fits,
        "applicable": c.applicable,
        "time_factor": round(c.time_factor, 4) if math.isfinite(c.time_factor) else None,
        "note": c.note,
    }


def document(
    workload: Workload,
    targets: Sequence[DeviceTarget],
    footprint: Footprint,
    candidates: Sequence[Candidate],
    plan: Plan | None,
    error: str | None = None,
    headroom: float = HEADROOM,
) -> dict[str, object]:
    """The ``--json`` document (schema in the module docstring)."""
    return {
        "schema": SCHEMA_VERSION,
        "workload": {
            "example": workload.example,
            "model": workload.model,
            "batch_size": workload.batch_size,
            "optimizer": workload.optimizer,
            "precision": workload.precision,
        },
        "headroom_fraction": headroom,
        "devices": [
            {
                "name": t.name,
                "kind": t.kind,
                "real": t.real,
                "memory_bytes": t.memory_bytes,
                "usable_bytes": t.usable_bytes,
            }
            for t in targets
        ],
        "footprint": {
            "batch_size": footprint.batch_size,
            "param_bytes": footprint.param_bytes,
            "grad_bytes": footprint.grad_bytes,
            "optimizer_bytes": footprint.optimizer_bytes,
            "activation_bytes": footprint.activation_bytes,
            "checkpointed_activation_bytes": footprint.checkpointed_activation_bytes,
            "transient_bytes": footprint.transient_bytes,
            "layers": len(footprint.layers),
            "source": footprint.source,
        },
        "strategies": [candidate_dict(c) for c in candidates],
        "plan": None
        if plan is None
        else {
            "strategy": plan.strategy,
            "label": plan.chosen.label,
            "micro_batch": plan.micro_batch,
            "accumulate": plan.accumulate,
            "activation_checkpointing": plan.activation_checkpointing,
            "devices": list(plan.devices),
            "nproc": plan.nproc,
            "chunks": plan.chunks,
            "balance": list(plan.balance) if plan.balance is not None else None,
            "effective_batch": plan.effective_batch,
            "reason": plan.reason,
            "command": plan.command,
            "python": plan.python,
            "train_settings": plan.settings.config_changes(),
        },
        "error": error,
    }
