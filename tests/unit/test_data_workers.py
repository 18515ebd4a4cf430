"""DataLoader workers in training runs: ``--num-workers auto`` (the rule, its record in
config.toml and summary.json), the data-wait share (summary, epoch line, warning), workers
that end with the run, and exact resume with workers drawing random augmentations."""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from tests.step_limit import train_until
from torchgpu import fit
from torchgpu.data import make_loader
from torchgpu.data import workers as workers_mod
from torchgpu.data.workers import MAX_AUTO_WORKERS, WorkerChoice, auto_choice, worker_choice
from torchgpu.errors import ConfigError
from torchgpu.train.config import TrainConfig
from torchgpu.train.config_checks import validate
from torchgpu.train.observe.data_wait import DataWait
from torchgpu.train.task import as_factory, seeded, user_task

FEATURES = 4


class Rows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``n`` fixed rows; each ``__getitem__`` sleeps ``sleep_s`` first (decoding, say)."""

    def __init__(self, n: int, sleep_s: float = 0.0) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, FEATURES, generator=g)
        self.y = torch.randn(n, 1, generator=g)
        self.sleep_s = sleep_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return self.x[i], self.y[i]


class Augmented(Rows):
    """Rows with noise drawn per sample from torch's, numpy's and Python's RNGs (as an
    augmentation does): in a worker each is seeded from the loader's base seed."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = super().__getitem__(i)
        noise = torch.rand(FEATURES) + float(np.random.rand()) + random.random()
        return x + 0.1 * noise, y


class SlowStep(nn.Module):
    """A tiny net whose forward also takes ``sleep_s`` (a step's compute, without using
    a core: the comparison holds however loaded the machine is)."""

    def __init__(self, sleep_s: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Linear(FEATURES, 1)
        self.sleep_s = sleep_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        out: torch.Tensor = self.net(x)
        return out


def _fit(model: nn.Module, data: Dataset[Any], out: Path, **kw: Any) -> dict[str, Any]:
    settings = {"epochs": 1, "batch_size": 8, "device": "cpu", "progress": "off", **kw}
    result = fit(model, data, loss=nn.functional.mse_loss, out=out, **settings)
    return result.summary


GIB = 1 << 30


@pytest.mark.parametrize(("cores", "processes", "device", "in_memory", "want"), [
    # CUDA: a worker per core of the process's share but one, pinned, at most 16
    (16, 1, "cuda", False, WorkerChoice(15, True, 2, False)),
    (8, 1, "cuda", False, WorkerChoice(7, True, 2, False)),
    (16, 4, "cuda", False, WorkerChoice(3, True, 2, False)),
    (16, 8, "cuda", False, WorkerChoice(1, True, 4, False)),  # few workers prefetch more
    (6, 2, "cuda", False, WorkerChoice(2, True, 4, False)),
    (2, 1, "cuda", False, WorkerChoice(1, True, 4, False)),
    (1, 1, "cuda", False, WorkerChoice(0, True, None, False)),  # the main process's core
    (4, 8, "cuda", False, WorkerChoice(0, True, None, False)),  # more processes than cores
    (256, 1, "cuda", False, WorkerChoice(MAX_AUTO_WORKERS, True, 2, False)),
    (16, 1, "cuda", True, WorkerChoice(0, True, None, False)),  # in-memory tensors
    # the CPU: its compute threads already use every core
    (16, 1, "cpu", False, WorkerChoice(0, False, None, False)),
    (16, 2, "cpu", False, WorkerChoice(0, False, None, False)),
    (16, 1, "mps", False, WorkerChoice(0, False, None, False)),
])
def test_auto_choice_table(cores: int, processes: int, device: str, in_memory: bool,
                           want: WorkerChoice) -> None:
    assert auto_choice(cores, processes, device, in_memory=in_memory) == want
    assert auto_choice(cores, processes, device, in_memory=in_memory, shm_bytes=64 * GIB) == want


@pytest.mark.parametrize(("shm", "workers"), [
    (64 << 20, 0),  # Docker's default /dev/shm: batches in flight would not fit
    (GIB - 1, 0),
    (GIB, 7),
    (None, 7),  # no /dev/shm to read: not limiting
])
def test_auto_loads_in_process_with_little_shared_memory(shm: int | None, workers: int) -> None:
    assert auto_choice(8, 1, "cuda", shm_bytes=shm).num_workers == workers


def test_auto_reads_the_affinity_and_local_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workers_mod.os, "sched_getaffinity", lambda pid: set(range(12)),
                        raising=False)
    monkeypatch.setattr(workers_mod, "shared_memory_bytes", lambda: 8 * GIB)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # torchrun: 3 processes share 12 cores
    assert worker_choice("auto", "cuda") == WorkerChoice(3, True, 2, False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert worker_choice("auto", "cuda").num_workers == 11  # 12 cores, the main process one
    assert worker_choice(3, "cpu") == WorkerChoice(3, False, None, False)  # as given
    # make_loader builds the chosen loader; a plain TensorDataset gets no workers
    loader = make_loader(Rows(32), 8, device="cuda", num_workers="auto")
    assert (loader.num_workers, loader.pin_memory, loader.prefetch_factor,
            loader.persistent_workers) == (11, True, 2, False)
    tensors = torch.utils.data.TensorDataset(torch.zeros(32, 2))
    assert make_loader(tensors, 8, device="cuda", num_workers="auto").num_workers == 0


@pytest.mark.parametrize("value", ["fast", True, 2.5])
def test_a_num_workers_that_is_neither_a_count_nor_auto_is_refused(value: Any) -> None:
    with pytest.raises(ConfigError, match="--num-workers") as info:
        validate(TrainConfig(example="housing", num_workers=value))
    assert "auto" in str(info.value)
    validate(TrainConfig(example="housing", num_workers="auto"))  # the default
    assert TrainConfig().num_workers == "auto"


def test_auto_is_kept_in_config_toml_and_resolved_in_summary(tmp_path: Path) -> None:
    summary = _fit(SlowStep(), Rows(32), tmp_path / "auto")
    assert summary["data_loader"] == {
        "num_workers": 0, "num_workers_setting": "auto", "pin_memory": False,
        "prefetch_factor": None, "persistent_workers": False}  # the CPU: in-process
    assert 'num_workers = "auto"' in (tmp_path / "auto" / "config.toml").read_text()
    two = _fit(SlowStep(), Rows(32), tmp_path / "two", num_workers=2)
    assert two["data_loader"]["num_workers"] == 2
    assert two["data_loader"]["prefetch_factor"] == 2  # torch's, as given
    assert "num_workers = 2" in (tmp_path / "two" / "config.toml").read_text()


def test_data_wait_share_follows_the_data_and_warns(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A step of ~20 ms on batches that take ~16 ms to load in the main process: about
    half the time waits for data, which warns; instant data, or two workers loading
    ahead, wait far less."""
    n, step_s, item_s = 8 * 40, 0.02, 0.002
    slow = _fit(SlowStep(step_s), Rows(n, item_s), tmp_path / "slow", progress="plain")
    out, err = capsys.readouterr()
    instant = _fit(SlowStep(step_s), Rows(n), tmp_path / "instant")
    instant_err = capsys.readouterr().err
    ahead = _fit(SlowStep(step_s), Rows(n, item_s), tmp_path / "ahead", num_workers=2)
    share = slow["data_wait_share"]
    assert share > instant["data_wait_share"]
    assert share > ahead["data_wait_share"]
    [epoch] = slow["data_wait_share_per_epoch"]
    assert (epoch["epoch"], epoch["share"]) == (1, share)
    assert 0.01 < epoch["first_batch_s"] < share * slow["train_seconds"]  # 8 rows of 2 ms
    on_disk = json.loads((tmp_path / "slow" / "summary.json").read_text())
    assert on_disk["data_wait_share"] == share
    assert f"data wait {share:.0%}" in out  # the epoch line
    assert "waiting for the next batch (--num-workers 0, chosen by auto)" in err
    assert "pass e.g. --num-workers 2" in err and err.count("warning: epoch") == 1
    assert "waiting for the next batch" not in instant_err


class SlowStart(Rows):
    """Rows whose first item in each process sleeps ``start_s`` (a worker opening its
    files, say), then loads at once."""

    def __init__(self, n: int, start_s: float) -> None:
        super().__init__(n)
        self.start_s, self.pid = start_s, 0

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pid != os.getpid():
            self.pid = os.getpid()
            time.sleep(self.start_s)
        return super().__getitem__(i)


def test_the_loaders_fill_is_reported_and_draws_no_advice_for_more_workers(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two workers that each take 0.8 s to start, then keep up with a 20 ms step: the
    epoch waits a large share of its time, nearly all of it for the first batch, which
    more workers would not shorten: recorded per epoch, and no warning."""
    summary = _fit(SlowStep(0.02), SlowStart(8 * 40, 0.8), tmp_path / "fill", num_workers=2)
    [epoch] = summary["data_wait_share_per_epoch"]
    assert epoch["share"] > 0.3 and 0.75 < epoch["first_batch_s"] < 2.0
    assert "waiting for the next batch" not in capsys.readouterr().err


def test_the_warning_leaves_out_the_first_batch_only_with_workers() -> None:
    wait, seconds, first = 0.9, 1.0, 0.8  # 90 % waiting, 80 % of it for the first batch
    assert DataWait(2, "auto").add(0, wait, seconds, first) is None  # 10 % after it
    in_process = DataWait(0, "auto").add(0, wait, seconds, first)  # every batch as slow
    assert in_process is not None and "spent 90% of its training time" in in_process
    steady = DataWait(2, "auto").add(0, 1.5, 2.0, 0.5)
    assert steady is not None and "50% of its training time waiting for the next batch " \
        "after the first batch (--num-workers 2, chosen by auto)" in steady
    assert DataWait(2, 2).summary()["data_wait_share_per_epoch"] == []


def _children() -> list[Any]:
    return multiprocessing.active_children()  # joins the finished ones, too


def test_workers_end_with_the_run_on_error_and_on_stop(tmp_path: Path) -> None:
    assert _children() == []
    calls = {"n": 0}

    def failing_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 6:  # mid-epoch, workers running (the probe calls it first)
            raise RuntimeError("the loss failed")
        return nn.functional.mse_loss(out, y)

    with pytest.raises(RuntimeError, match="the loss failed") as info:
        fit(SlowStep(), Rows(64), loss=failing_loss, epochs=1, batch_size=8, device="cpu",
            progress="off", out=tmp_path / "error", num_workers=2)
    assert info.traceback  # the error, with the loop's frames, is still held here
    assert _children() == []
    task = user_task(as_factory(SlowStep()), Rows(64), loss=nn.functional.mse_loss, name="SlowStep")
    config = TrainConfig(model="fit:SlowStep", data="fit:Rows", out=str(tmp_path / "stop"),
                         epochs=2, batch_size=8, device="cpu", progress="off", num_workers=2)
    stopped = train_until(3, config, task=task)
    assert stopped.summary["stopped_early"]
    assert _children() == []
    # At step 6 of 8 the next epoch's workers already run (started with 4 batches left)
    later = TrainConfig(**{**config.__dict__, "out": str(tmp_path / "later")})
    assert train_until(6, later, task=task).summary["stopped_early"]
    assert _children() == []


#: Set in the child pytest that runs a test in an interpreter of its own.
ISOLATED_ENV = "TORCHGPU_TEST_ISOLATED"


@pytest.mark.timeout(420)
def test_resume_with_workers_is_bitwise_with_random_augmentation(tmp_path: Path) -> None:
    """Runs in a fresh interpreter (a child pytest, bounded): it forks DataLoader workers
    in four runs, and a fork copies whatever locks the threads other tests left in a
    shared xdist worker hold at that moment."""
    if os.environ.get(ISOLATED_ENV) != "1":
        from tests.procs import REPO, test_env

        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
             f"{__file__}::test_resume_with_workers_is_bitwise_with_random_augmentation",
             "--basetemp", str(tmp_path / "child")],
            env=test_env(**{ISOLATED_ENV: "1"}), cwd=REPO, capture_output=True, text=True,
            timeout=360, check=False)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
        return

    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(FEATURES, 8), nn.ReLU(), nn.Linear(8, 1))

    settings: dict[str, Any] = {"epochs": 2, "batch_size": 8, "seed": 5, "device": "cpu",
                                "progress": "off", "num_workers": 2, "save_every": 2}
    whole = fit(model, Augmented(48), loss=nn.functional.mse_loss, out=tmp_path / "whole",
                **settings)
    other = fit(model, Augmented(48), loss=nn.functional.mse_loss, out=tmp_path / "other",
                **{**settings, "seed": 6})
    task = user_task(seeded(model, 5), Augmented(48), loss=nn.functional.mse_loss, name="model")
    config = TrainConfig(model="fit:model", data="fit:Augmented", out=str(tmp_path / "cut"),
                         **settings)
    train_until(8, config, task=task)  # mid-epoch 2 (6 steps an epoch)
    resumed = fit(model, Augmented(48), loss=nn.functional.mse_loss, out=tmp_path / "cut",
                  resume=True, **settings)
    assert resumed.summary["steps"] == whole.summary["steps"] == 12
    a, b, c = (r.model.state_dict() for r in (whole, resumed, other))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)  # the seed (and noise) matters


def _calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Records each epoch's iterator start and each evaluation, in order."""
    from torchgpu.train import runner
    from torchgpu.train.checkpoints.run_checkpoints import RunCheckpoints

    calls: list[tuple[str, int]] = []
    start, evaluate = RunCheckpoints.start_epoch, runner._Run._evaluate

    def started(self: Any, loader: Any, seed: int, epoch: int, skip: int = 0) -> Any:
        calls.append(("start", epoch))
        return start(self, loader, seed, epoch, skip)

    def evaluated(self: Any, epoch: int, totals: Any) -> None:
        calls.append(("evaluate", epoch))
        evaluate(self, epoch, totals)

    monkeypatch.setattr(RunCheckpoints, "start_epoch", started)
    monkeypatch.setattr(runner._Run, "_evaluate", evaluated)
    return calls


def _trained(calls: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """``calls`` with each run of training forwards as one ("train", count) entry."""
    merged: list[tuple[str, int]] = []
    for kind, n in calls:
        if kind == "forward" and merged and merged[-1][0] == "train":
            merged[-1] = ("train", merged[-1][1] + 1)
        else:
            merged.append(("train", 1) if kind == "forward" else (kind, n))
    return merged


def test_workers_load_the_next_epoch_while_this_one_ends(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With workers the next epoch's iterator starts once this epoch's last batches are
    in the workers' queues (2 workers x 2 batches: 4 of its 6 batches left), so its
    workers fork and fill their queues while those train and the model is evaluated; not
    after the last epoch, and not without workers (nothing to start ahead)."""
    calls = _calls(monkeypatch)
    model = SlowStep()
    model.register_forward_hook(
        lambda module, args, out: calls.append(("forward", 0)) if module.training else None)
    _fit(model, Rows(48), tmp_path / "workers", num_workers=2, epochs=3, eval_data=Rows(8))
    assert _trained(calls) == [("train", 1), ("start", 0),  # the probe's forward first
                               ("train", 2), ("start", 1), ("train", 4), ("evaluate", 0),
                               ("train", 2), ("start", 2), ("train", 4), ("evaluate", 1),
                               ("train", 6), ("evaluate", 2)]
    assert _children() == []
    calls.clear()
    _fit(SlowStep(), Rows(48), tmp_path / "in-process", num_workers=0, epochs=2)
    assert calls == [("start", 0), ("evaluate", 0), ("start", 1), ("evaluate", 1)]


def test_the_next_epoch_s_workers_end_when_the_evaluation_fails(tmp_path: Path) -> None:
    evaluated = {"n": 0}

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # the probe of the held-out split, then epoch 1's
            evaluated["n"] += 1
            if evaluated["n"] == 2:
                raise RuntimeError("the evaluation failed")
        return nn.functional.mse_loss(out, y)

    with pytest.raises(RuntimeError, match="the evaluation failed") as info:
        fit(SlowStep(), Rows(64), eval_data=Rows(16), loss=loss, epochs=2, batch_size=8,
            device="cpu", progress="off", out=tmp_path / "run", num_workers=2)
    assert info.traceback  # the error, with the runner's frame, is still held here
    assert _children() == []


def test_a_loader_with_workers_seeds_them_from_its_own_generator() -> None:
    """Not from the global RNG: starting an epoch's iterator leaves it as it was, so
    when the iterator starts (ahead of an evaluation or not) changes nothing."""
    for shuffle in (True, False):
        loader = make_loader(Rows(16), 4, shuffle=shuffle, num_workers=2)
        assert isinstance(loader.generator, torch.Generator)
        before = torch.get_rng_state()
        batches = iter(loader)
        assert torch.equal(torch.get_rng_state(), before)
        del batches
    assert make_loader(Rows(16), 4, shuffle=False, num_workers=0).generator is None


class _DiesAway:
    """Garbage whose finalizer kills any process but its maker's (as a C++ thread's
    owner does when destroyed in a forked child)."""

    def __init__(self) -> None:
        self.pid, self.cycle = os.getpid(), self

    def __del__(self) -> None:
        if os.getpid() != self.pid:
            os._exit(3)


class Collecting(Rows):
    """Rows whose every item runs the collector (in a worker: over what it inherited)."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        gc.collect()
        return super().__getitem__(i)


def test_workers_never_finalize_the_garbage_this_process_left() -> None:
    """Garbage made before an epoch starts (a cycle the collector has not reached yet) is
    not collected inside its DataLoader workers: a finalizer that must not run in a fork
    (here one that exits the process) would take a worker down."""
    from torchgpu.train.loop.epoch import start_epoch

    loader = make_loader(Collecting(32), 8, num_workers=2)
    enabled = gc.isenabled()
    gc.disable()  # the cycle stays uncollected until the workers fork
    try:
        _DiesAway()
        batches = start_epoch(loader, 0, 0)
        try:
            assert sum(int(x.shape[0]) for x, _ in batches) == 32
        finally:
            batches.close()
    finally:
        if enabled:
            gc.enable()
        gc.collect()  # here, in its own process, the finalizer does nothing
