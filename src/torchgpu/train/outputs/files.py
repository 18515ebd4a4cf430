"""A run's output files: the metrics JSONL, the summary JSON, the loss plot and the model.

Per-step values are kept in memory by the loop (plain tuples, no I/O on the hot
path) and written here at each epoch's end, and within an epoch every ``--log-every``
steps or :data:`STEP_FLUSH_S` seconds (:mod:`torchgpu.train.outputs.step_log`). Only rank 0
calls the writers.
"""

from __future__ import annotations

import io
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchgpu.train.config_file import CONFIG_FILE as CONFIG_FILE
from torchgpu.train.outputs.loss_plot import render

METRICS_FILE = "metrics.jsonl"
#: Without --log-every: step records reach metrics.jsonl at least this often (seconds).
STEP_FLUSH_S = 10.0
SUMMARY_FILE = "summary.json"
PLOT_FILE = "loss.png"
MODEL_FILE = "model.safetensors"
# an fsdp run's final model above the gather limit, as shards (torchgpu.train.outputs.final_model)
MODEL_SHARDS_DIR = "model-shards"
CHECKPOINTS_DIR = "checkpoints"  # kept by torchgpu.train.checkpoints.run_checkpoints
TENSORBOARD_DIR = "tensorboard"  # --log tensorboard (torchgpu.train.observe.tensorboard)
PROFILE_TRACE_FILE = "profile.trace.json"  # --profile (torchgpu.train.observe.profiler)
PROFILE_TABLE_FILE = "profile.txt"
#: What a run may write directly under --out, name -> whether it is a directory.
RUN_ENTRIES = {SUMMARY_FILE: False, METRICS_FILE: False, PLOT_FILE: False, MODEL_FILE: False,
               CONFIG_FILE: False, CHECKPOINTS_DIR: True, TENSORBOARD_DIR: True,
               PROFILE_TRACE_FILE: False, PROFILE_TABLE_FILE: False, MODEL_SHARDS_DIR: True}


def run_entries(out_dir: Path) -> list[str]:
    """The names of :data:`RUN_ENTRIES` present in ``out_dir`` (a dangling link counts:
    it stands where the run writes)."""
    return [name for name in RUN_ENTRIES if os.path.lexists(out_dir / name)]


@dataclass(frozen=True)
class EpochRecord:
    """One epoch's results; ``metrics`` are the task's, by name (written ``test_<name>``:
    ``test_r2`` for the housing example, ``test_accuracy`` for lenet)."""

    epoch: int
    step: int  # optimizer steps taken so far (global)
    train_loss: float  # mean over the epoch's micro-batches
    test_loss: float
    samples_per_s: float  # training samples per second, this process
    seconds: float  # wall time of the epoch's training part
    metrics: Mapping[str, float] = field(default_factory=dict)  # the task's, by name

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": "epoch",
            "epoch": self.epoch,
            "step": self.step,
            "train_loss": self.train_loss,
            "test_loss": self.test_loss,
            **{f"test_{name}": value for name, value in self.metrics.items()},
            "samples_per_s": self.samples_per_s,
            "seconds": self.seconds,
        }


@dataclass
class MetricsBuffer:
    """Step records ``(step, epoch, loss)`` collected in memory until :func:`flush`;
    ``lrs``: the learning rate of each step (``TrainState.step_lrs``, step ``s`` at
    ``s - 1``), written as ``lr`` where known."""

    steps: list[tuple[int, int, float]] = field(default_factory=list)
    epochs: list[EpochRecord] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    # steps[:written] are on disk already (a flush inside the epoch, train.step_log); the
    # list itself is kept to the epoch's end, which the observers (tensorboard) read
    written: int = 0

    def take_lines(self) -> list[str]:
        """JSON lines for every step record not written yet; empties the step list."""
        lines = self._lines(self.steps[self.written:])
        self.steps.clear()
        self.written = 0
        return lines

    def take_ready(self, last_step: int | None) -> list[str]:
        """JSON lines for the records not written yet up to optimizer step ``last_step``
        (None: all), marked written; the list is kept."""
        end = len(self.steps)
        if last_step is not None:
            while end > self.written and self.steps[end - 1][0] > last_step:
                end -= 1
        lines = self._lines(self.steps[self.written:end])
        self.written = max(self.written, end)
        return lines

    def _lines(self, steps: Sequence[tuple[int, int, float]]) -> list[str]:
        # What json.dumps writes for these dicts, formatted directly (3x faster; the demo
        # writes ~5,000). Non-finite losses are null, as _finite makes them.
        real, finite, lrs = float.__repr__, math.isfinite, self.lrs
        lines = []
        for s, e, v in steps:
            loss = real(float(v)) if finite(v) else "null"
            lr = f', "lr": {real(lrs[s - 1])}' if s <= len(lrs) and finite(lrs[s - 1]) else ""
            lines.append(f'{{"kind": "step", "step": {s:d}, "epoch": {e:d}, "loss": {loss}{lr}}}')
        return lines


def _finite(value: float) -> float | None:
    """JSON has no NaN/inf: non-finite values are written as null."""
    return value if math.isfinite(value) else None


def append_lines(path: Path, lines: Sequence[str], sync: bool = True) -> None:
    """Append ``lines`` to the JSONL file at ``path``: one write, flushed, so a crash of
    the process can cut at most the lines of this call, never an earlier one (a resumed
    run rewrites the file from its checkpoint anyway). ``sync``: fsync the file too (all
    its lines then survive power loss); the per-epoch and periodic appends of a run
    leave that to the run's end (:func:`write_outputs`): an fsync costs milliseconds,
    a tenth of a second over the demo's 40 epochs, and resuming never reads this file."""
    if not lines:
        return
    with path.open("a", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")
        handle.flush()
        if sync:
            os.fsync(handle.fileno())


def sync_file(path: Path) -> None:
    """fsync the file at ``path`` (one that exists), so what was appended survives power
    loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def flush_epoch(out_dir: Path, buffer: MetricsBuffer, record: EpochRecord) -> None:
    """Append the buffered step records and ``record`` to ``out_dir/metrics.jsonl``
    (not fsynced: :func:`write_outputs` does that at the run's end)."""
    lines = buffer.take_lines()
    lines.append(json.dumps({k: _json_value(v) for k, v in record.as_dict().items()}))
    append_lines(out_dir / METRICS_FILE, lines, sync=False)


def _json_value(value: Any) -> Any:
    if isinstance(value, float):
        return _finite(value)
    return value


def write_json(path: Path, payload: Mapping[str, Any]) -> None:
    """Write ``payload`` as indented JSON, atomically (temporary sibling, fsync, rename);
    a failure is a one-paragraph :class:`~torchgpu.errors.CheckpointWriteError`."""
    from torchgpu.checkpoint.atomic import write_file_atomic

    text = json.dumps(_clean(payload), indent=2, sort_keys=False) + "\n"
    write_file_atomic(path, text.encode("utf-8"))


def _clean(value: Any) -> Any:
    if isinstance(value, float):
        return _finite(value)
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def plot_losses(path: Path, epochs: Sequence[EpochRecord], title: str,
                lrs: Sequence[float] = ()) -> None:
    """Save a PNG of train and test loss per epoch (:func:`torchgpu.train.outputs.loss_plot.render`;
    ``lrs``, the learning rate per step, in a panel below when it changed), atomically
    like every other output file."""
    from torchgpu.checkpoint.atomic import write_file_atomic

    image = io.BytesIO()
    render(image, [r.epoch + 1 for r in epochs], [r.train_loss for r in epochs],
           [r.test_loss for r in epochs], title, lrs)
    write_file_atomic(path, image.getbuffer())


def save_model(path: Path, state: Mapping[str, Any]) -> None:
    """Write ``state`` (canonical keys) as safetensors at ``path``, atomically (temporary
    sibling, fsync, rename), with the mode every other file of the run gets (0o666 less
    the umask; safetensors' own ``save_file`` would leave a 0600 temporary file).
    Tensors may sit on any device: aliases are found before they are copied to the CPU."""
    from torchgpu.checkpoint.atomic import write_file_atomic
    from torchgpu.checkpoint.layout import model_bytes

    # Tied weights (one tensor under two names) are stored once; the other names are
    # recorded as aliases in the file's metadata and re-created by torchgpu's loaders.
    data, _ = model_bytes(state)
    write_file_atomic(path, data)


def write_outputs(out_dir: Path, records: Sequence[EpochRecord],
                  state: Mapping[str, Any] | None, summary: dict[str, Any], title: str,
                  lrs: Sequence[float] = ()) -> None:
    """A finished run's files in ``out_dir``: the loss plot (when there are epochs; with
    ``lrs``, the learning rate per step), the final model (``state``; ``None``: it was
    written sharded as ``model-shards/``), and the summary, which gains a ``files``
    entry naming all of them; metrics.jsonl, appended through the run without fsync, is
    synced first."""
    metrics = out_dir / METRICS_FILE
    if metrics.is_file():
        sync_file(metrics)
    if records:
        plot_losses(out_dir / PLOT_FILE, records, title, lrs)
    if state is not None:
        save_model(out_dir / MODEL_FILE, state)
    summary["files"] = {
        "metrics": str(out_dir / METRICS_FILE),
        "summary": str(out_dir / SUMMARY_FILE),
        "plot": str(out_dir / PLOT_FILE) if records else None,
        "model": str(out_dir / (MODEL_FILE if state is not None else MODEL_SHARDS_DIR)),
        **(summary.get("files") or {}),  # what else the run wrote (config, profile...)
    }
    write_json(out_dir / SUMMARY_FILE, summary)
