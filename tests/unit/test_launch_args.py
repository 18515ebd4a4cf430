"""The launcher hands a worker's arguments to torchrun untouched, even flags that
abbreviate one of torchrun's own options (argparse would refuse them as ambiguous)."""

from __future__ import annotations

from typing import Any

import pytest

from torchgpu import launcher


def test_worker_flags_that_abbreviate_torchrun_options_pass_through(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    import torch.distributed.run as torchrun

    monkeypatch.setattr(torchrun, "run", seen.append)
    worker = ["train", "--log", "tensorboard", "--log-dir", "x", "--nproc", "3", "--rdzv"]
    code = launcher.run(launcher.LaunchSpec(nproc=2, module=True), "torchgpu", worker)
    assert code == 0
    (args,) = seen
    assert args.training_script == "torchgpu" and args.module
    assert args.training_script_args == worker
    assert args.nproc_per_node == "2"
