"""The rich bar follows the epochs (label, loss) and shows memory on a CPU (RSS)."""

from __future__ import annotations

import io

import pytest

from torchgpu.train.observe.progress import (
    PlainProgress,
    RichProgress,
    process_rss_bytes,
    read_process_rss,
)
from torchgpu.train.outputs.files import EpochRecord
from torchgpu.train.state import TrainState


def _record(epoch: int, loss: float) -> EpochRecord:
    return EpochRecord(epoch=epoch, step=4 * (epoch + 1), train_loss=loss, test_loss=1.0,
                       samples_per_s=1000.0, seconds=0.1, metrics={"r2": 0.5})


def test_rich_bar_moves_to_the_next_epoch_with_its_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    bar = RichProgress(memory=read_process_rss)
    bar.start(epochs=3, steps_per_epoch=4)
    try:
        progress = bar._progress
        monkeypatch.setattr(progress.console, "print", lambda *a, **k: None)
        state = TrainState(epoch=0, batch_in_epoch=2)
        bar.update(state, loss=518.3, samples_per_s=10.0)  # throttled: the last one seen
        fields = progress.tasks[0].fields
        assert fields["epoch"] == "1/3" and fields["loss"] == "518.3"
        bar.end_epoch(_record(0, 321.25), 3)
        fields = progress.tasks[0].fields
        assert fields["epoch"] == "2/3" and fields["loss"] == "321.2"
        assert progress.tasks[0].completed == 4
        assert fields["memory"].startswith("RSS ") and fields["memory"].endswith(" GiB")
        bar.end_epoch(_record(2, 99.5), 3)  # the last epoch: the label stays in range
        assert progress.tasks[0].fields["epoch"] == "3/3"
    finally:
        bar.close()


def test_cpu_memory_column_is_the_process_rss() -> None:
    rss = process_rss_bytes()
    assert 10 * 2**20 < rss < 64 * 2**30  # a Python process with torch loaded
    stream = io.StringIO()
    PlainProgress(stream, read_process_rss).end_epoch(_record(0, 2.0), 1)
    assert "RSS " in stream.getvalue() and "epoch 1/1" in stream.getvalue()
