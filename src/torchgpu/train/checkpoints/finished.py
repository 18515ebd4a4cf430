"""The result of a run ``--autoresume`` found finished
(:mod:`torchgpu.train.checkpoints.autoresume`): what :func:`torchgpu.fit` returns when
there is nothing to do."""

from __future__ import annotations

import sys
from pathlib import Path

from torchgpu.checkpoint import load_state_dict
from torchgpu.distributed import DistEnv
from torchgpu.train.checkpoints.autoresume import RunFinished
from torchgpu.train.checkpoints.history import epoch_records
from torchgpu.train.outputs import files as outputs
from torchgpu.train.outputs.report import TrainResult
from torchgpu.train.state import TrainState
from torchgpu.train.task import Task


def finished_result(done: RunFinished, task: Task) -> TrainResult:
    """The :class:`~torchgpu.train.outputs.report.TrainResult` of the finished run ``done`` found:
    its summary, its epoch records (from metrics.jsonl) and ``task``'s model holding
    the final weights (model.safetensors); the message is printed (rank 0) and kept in
    ``notes``."""
    config = done.config
    assert config.out is not None
    out = Path(config.out)
    main = DistEnv.from_env().is_main
    if main:
        print(f"note: {done}", file=sys.stderr)
    model = task.build_model()
    final = out / outputs.MODEL_FILE
    if not final.exists() and (out / outputs.MODEL_SHARDS_DIR).is_dir():
        final = out / outputs.MODEL_SHARDS_DIR  # an fsdp run's model above the gather limit
    load_state_dict(model, final)
    records = epoch_records(out / outputs.METRICS_FILE)
    steps = done.summary.get("steps")
    state = TrainState(epoch=len(records), step=steps if isinstance(steps, int) else 0)
    return TrainResult(config, done.summary, state, tuple(records), model,
                       out if main else None, (f"note: {done}",))
