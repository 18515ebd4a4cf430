"""The launcher hands a worker's arguments to torchrun untouched, even flags that
abbreviate one of torchrun's own options (argparse would refuse them as ambiguous)."""

from __future__ import annotations

from typing import Any

import pytest

from torchgpu.launch import run as launcher


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


def test_a_scripts_own_negative_values_are_not_rewritten() -> None:
    """The CLI parsers attach negative-looking values to their own flags; after
    ``launch``'s SCRIPT everything is the script's and is passed on as written."""
    from torchgpu.cli.launch import _parser

    args = _parser().parse_args(["--nproc", "2", "job.py", "--nproc", "-1", "--lr", "-.5"])
    assert args.nproc == 2 and args.script == "job.py"
    assert args.args == ["--nproc", "-1", "--lr", "-.5"]
    from torchgpu.cli.common import attach_values

    assert attach_values(["--max-restarts", "-1,2", "job.py", "--max-restarts", "-3"],
                         ["--max-restarts"], until_positional=True) == [
        "--max-restarts=-1,2", "job.py", "--max-restarts", "-3"]
