"""The planner's memory estimate next to the measured peak, in ``summary.json``.

Every run records ``peak_memory_bytes`` per device and, on CUDA, the estimate beside it
(``estimated_peak_bytes``), so each GPU run checks the estimator:

- ``--strategy auto`` ran the planner (a big step): its row for the strategy that ran
  (``source: "planner"``), no extra work;
- a CUDA run, or ``--estimate-memory`` (``fit(estimate_memory=True)``) on any device:
  :func:`torchgpu.estimate_memory` on the run's model and a batch of its data after
  training, about a second on fake tensors (``source: "estimate_memory"``);
- otherwise (CPU, not asked) nothing is estimated and ``memory_estimate`` says why
  (``source: null``): a CPU peak is the process's resident memory, Python and the data
  set included, so the comparison says little there and would cost a short run ~10%.

The estimate leaves out the CUDA context (~0.3-0.5 GiB) and on CPU compares with the
process's peak resident memory, which includes Python and the data set: read the
ratio, not equality.
"""

from __future__ import annotations

from typing import Any

from torchgpu.train import strategies
from torchgpu.train.config import TrainConfig

NOT_ASKED = ("not estimated on CPU (its peak is the process's resident memory, Python and "
             "data included): pass --estimate-memory (about a second) to compare the "
             "planner's estimate with the measured peak anyway")


def from_plan(plan: Any, mode: str) -> dict[str, Any] | None:
    """The planner's row for strategy ``mode`` (its pick when that is ``mode``)."""
    rows = [plan.chosen, *plan.candidates]
    row = next((c for c in rows if c.strategy == mode and c.applicable), None)
    if row is None:
        return None
    return {"source": "planner", "strategy": row.label, "micro_batch": row.micro_batch,
            "per_device_bytes": list(row.per_device_bytes), "devices": list(row.devices)}


def from_estimator(config: TrainConfig, task: Any, mode: str, world: int, device: str
                   ) -> dict[str, Any]:
    """:func:`torchgpu.estimate_memory` for the run's settings on a fresh model
    (``device``: the run's, naming the one device of ``single``)."""
    from torchgpu.memory.estimate import estimate_memory

    # The strategy that ran -> estimate_memory's name for it (declared by the strategy;
    # dp, one process driving every GPU through nn.DataParallel, has no estimator model).
    strategy = strategies.get(mode).features.estimate
    if strategy is None:
        return {"source": None, "note": f"not estimated: the estimator has no model of {mode}"}
    assert config.batch_size is not None
    options: dict[str, Any] = {}
    if strategy in ("split", "pipeline") and config.devices:
        options["devices"] = [d.strip() for d in config.devices.split(",")]
        if config.balance and config.balance.replace(",", "").isdigit():
            options["balance"] = [int(b) for b in config.balance.split(",")]
        if strategy == "pipeline" and isinstance(config.chunks, int):
            options["chunks"] = config.chunks
    elif strategy in ("ddp", "fsdp"):
        options["world_size"] = world
    else:
        options["devices"] = [device]
    sample = task.sample(config.batch_size)[0]
    precision = "fp32" if config.precision == "auto" else config.precision
    estimate = estimate_memory(task.build_model(), sample, optimizer="adam",
                               precision=precision, strategy=strategy,
                               activation_checkpointing=config.activation_checkpointing,
                               **options)
    return {"source": "estimate_memory", "strategy": strategy,
            "micro_batch": config.batch_size,
            "per_device_bytes": [d.peak_bytes for d in estimate.devices],
            "devices": [d.device for d in estimate.devices]}


def memory_estimate(config: TrainConfig, plan: Any | None, task: Any, mode: str,
                    world: int, device: str = "cpu") -> dict[str, Any]:
    """The ``memory_estimate`` entry of the summary (see the module docstring)."""
    if plan is not None:
        found = from_plan(plan, mode)
        if found is not None:
            return found
    if not (config.estimate_memory or device.startswith("cuda")):
        return {"source": None, "note": NOT_ASKED}
    try:
        return from_estimator(config, task, mode, world, device)
    except Exception as error:  # an estimate is evidence, never a reason to fail the run
        return {"source": None, "note": f"estimate_memory failed: {error}"}


def annotate_devices(devices: list[dict[str, Any]], entry: dict[str, Any]) -> None:
    """Add ``estimated_peak_bytes`` to each summary device entry: a rank's own row (ddp,
    fsdp: every rank holds the same), or the one stage of a one-process split."""
    estimates = entry.get("per_device_bytes") or []
    if not estimates:
        return
    for i, device in enumerate(devices):
        device["estimated_peak_bytes"] = estimates[i] if i < len(estimates) else estimates[0]
    if len(estimates) > len(devices):  # one process over several stage devices
        devices[0]["estimated_peak_bytes"] = max(estimates)
