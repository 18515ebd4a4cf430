"""The multi-process stage pipeline (`--strategy pipeline --nproc 2`, one stage per gloo
process on 127.0.0.1) is a run like any other: it goes through the shared run driver, so

- a run stopped by a crash (the fault hook) or by SIGTERM and continued with `--resume`
  ends bitwise equal to the uninterrupted run (checkpoints hold the whole model and every
  stage's optimizer state, keyed by parameter, so any cut of the model restores it);
- `--precision bf16` runs the stages' forward under autocast (fp16 is refused with why);
- the planted hang is named with its rank and step;
- `--profile`, `--log tensorboard` and `--estimate-memory` write what they do for every
  other strategy;
- a model or data the pipeline cannot cut is refused by the launcher, once, before any
  worker starts.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

from tests.distributed.proctree import Session
from tests.distributed.test_hang import MARGIN_S, TIMEOUT_S, _until_exit
from tests.procs import HEAVY, run_cli
from tests.stage_models import dropout_bn
from torchgpu.checkpoint import verify_checkpoint

STAGES = ["--strategy", "pipeline", "--nproc", "2", "--progress", "plain"]
# 70 rows in batches of 8 (the last one 6), windows of 2: 5 steps per epoch, 15 in all;
# micro-batches of 4 (3) rows, as BatchNorm needs more than one.
USER = ["train", "--model", "tests.stage_models:dropout_bn", "--data",
        "tests.stage_models:regression", "--loss", "mse", *STAGES, "--balance", "4,4",
        "--chunks", "2", "--epochs", "3", "--batch-size", "8", "--accumulate", "2"]


def _lines(out: Path, kind: str) -> list[dict[str, Any]]:
    """metrics.jsonl records of ``kind``, without the timings (which differ per run)."""
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("seconds", "samples_per_s")}
            for r in records if r["kind"] == kind]


def _same_run(a: Path, b: Path) -> None:
    """Bitwise: the model file's bytes, every step's loss and every epoch's metrics."""
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert _lines(a, "step") == _lines(b, "step")
    assert _lines(a, "epoch") == _lines(b, "epoch")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("whole") / "run"
    done = run_cli([*USER, "--out", str(out)], timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.slow
@HEAVY
@pytest.mark.timeout(900)  # three runs (the fixture's too)
def test_a_crashed_run_resumes_bitwise(tmp_path: Path, uninterrupted: Path) -> None:
    """Rank 1 is killed after step 7 (the last save: step 6, mid-epoch); `--resume`
    continues from step 6 and ends bitwise equal to the uninterrupted run: both ranks'
    stage weights, BatchNorm statistics, optimizer states and random states are restored."""
    out = tmp_path / "run"
    crashed = run_cli([*USER, "--save-every", "3", "--out", str(out)], timeout=180,
                      TORCHGPU_FAULT_CRASH_AT_STEP="7", TORCHGPU_FAULT_RANK="1",
                      TORCHGPU_FAULT_MARKER=str(tmp_path / "crashed"))
    assert crashed.returncode != 0 and (tmp_path / "crashed").exists()
    saved = out / "checkpoints" / "step-00000006"
    verify_checkpoint(saved)
    # The checkpoint (rank 0's files) holds the whole model under the plain model's keys
    # and both stages' optimizer states, one entry per parameter of the model.
    model = dropout_bn()
    assert load_file(saved / "model.safetensors").keys() == model.state_dict().keys()
    state = torch.load(saved / "state.pt", weights_only=True)
    assert state["optimizer"]["format"] == "torchgpu.stage-optimizers/1"
    assert sorted(state["optimizer"]["params"]) == sorted(n for n, _ in model.named_parameters())
    assert all(e["state"] for e in state["optimizer"]["params"].values())  # Adam's moments
    resumed = run_cli([*USER, "--save-every", "3", "--resume", "--out", str(out)],
                      timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr and "step 6" in resumed.stderr
    _same_run(out, uninterrupted)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["checkpoints"]["resumed_from"].endswith("step-00000006")
    assert summary["steps"] == 15 and summary["strategy"] == "pipeline"


@pytest.mark.slow
@HEAVY
@pytest.mark.timeout(900)  # three runs
def test_a_sigterm_stops_both_stages_saved_and_resume_is_bitwise(tmp_path: Path) -> None:
    """SIGTERM to the launcher reaches both ranks; they agree on one step boundary (the
    step's all-reduce), save there and exit 0; `--resume` then ends as the uninterrupted
    run (housing: 10 steps per epoch, 10 epochs; the stop lands a step or so after the
    first save, at step 20: step 21 was seen, also on a loaded machine, far from step 100)."""
    flags = ["train", "--example", "housing", "--data-size", "100", "--batch-size", "8",
             "--epochs", "10", *STAGES]
    whole = tmp_path / "whole"
    done = run_cli([*flags, "--out", str(whole)], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "run"
    saves = ["--save-every", "20", "--keep-last", "2"]
    with Session([*flags, *saves, "--out", str(out)], tmp_path) as run:
        run.wait_for(out / "checkpoints" / "latest")
        run.look()
        os.kill(run.pid, signal.SIGTERM)
        code = run.wait(60)
    assert not run.leftovers, f"processes left running: {run.leftovers}"
    assert code == 0, run.stderr()[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_early"] and "SIGTERM" in summary["stop_reason"]
    step = summary["stopped_at_step"]
    assert 20 <= step < 100
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step-{step:08d}"
    verify_checkpoint(out / "checkpoints" / latest)
    resumed = run_cli([*flags, *saves, "--resume", "--out", str(out)], timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _same_run(out, whole)


@pytest.mark.slow
def test_bf16_runs_the_stages_forward_under_autocast(tmp_path: Path) -> None:
    """bf16 over two stage processes follows the one-process bf16 run (the same autocast
    forward and loss, in micro-batches), not the fp32 one."""
    from torchgpu.cli.train_flags import config_from_argv
    from torchgpu.train.runner import train

    common = ["--example", "housing", "--data-size", "123", "--epochs", "2",
              "--batch-size", "13", "--progress", "off"]
    out = tmp_path / "stages"
    done = run_cli(["train", *common, *STAGES, "--precision", "bf16", "--out", str(out)],
                   timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    one: dict[str, list[float]] = {}
    for precision in ("bf16", "fp32"):
        result = train(config_from_argv([*common, "--device", "cpu", "--precision", precision,
                                         "--out", str(tmp_path / precision)]))
        one[precision] = list(result.state.step_losses)
    staged = [r["loss"] for r in _lines(out, "step")]
    assert json.loads((out / "summary.json").read_text())["precision"] == "bf16"
    assert staged == pytest.approx(one["bf16"], rel=1e-3)
    # The first step's loss is the forward's alone (no update yet): bf16's rounding, not
    # fp32's, which it misses by ~1e-5 here while matching bf16 to ~1e-7.
    first = staged[0]
    assert abs(first - one["bf16"][0]) * 10 < abs(first - one["fp32"][0]), (first, one)


def test_fp16_is_refused_with_the_reason() -> None:
    from torchgpu.errors import UsageError
    from torchgpu.train.config import TrainConfig
    from torchgpu.train.config_checks import validate

    with pytest.raises(UsageError) as error:
        validate(TrainConfig(strategy="pipeline", nproc=2, precision="fp16"))
    message = str(error.value)
    assert "(it takes fp32, bf16, auto)" in message and "GradScaler" in message
    assert "only its own stages' gradients for inf/NaN" in message and "\n" not in message


@pytest.mark.slow
@pytest.mark.timeout(600)  # a start (START_S at most), then the hang's bounded end
@pytest.mark.parametrize(("rank", "other"), [(1, 0), (0, 1)])
def test_a_stage_that_never_arrives_is_named_with_its_step(tmp_path: Path, rank: int,
                                                           other: int) -> None:
    """The planted hang blocks ``rank`` before step 3's schedule; the other stage times out
    in its send or receive, and the launcher names the missing rank and the step."""
    args = ["train", "--example", "housing", "--data-size", "200", "--batch-size", "8",
            "--epochs", "50", "--device", "cpu", *STAGES, "--collective-timeout",
            str(TIMEOUT_S), "--out", str(tmp_path / "run")]
    code, err, took = _until_exit(Session(args, tmp_path, TORCHGPU_FAULT_HANG_AT_STEP="3",
                                          TORCHGPU_FAULT_RANK=str(rank)))
    assert code == 1, err[-3000:]
    assert took < TIMEOUT_S + MARGIN_S, f"the run ended {took:.1f} s after the hang"
    paragraph = next(line for line in err.splitlines() if "the run hung" in line)
    assert (f"rank(s) {other} waited for {TIMEOUT_S} s in the stages' sends and receives "
            f"of step 3, which rank(s) {rank} did not reach") in paragraph, paragraph
    assert f"rank {rank}: in step 3" in paragraph and "faults.py" in paragraph
    assert "hanging before step 3's stage schedule (its sends and receives)" in paragraph
    assert "Traceback" not in err, err[-3000:]


@pytest.mark.slow
def test_profile_tensorboard_and_memory_estimate(tmp_path: Path) -> None:
    from tests.unit.test_tensorboard_log import _scalars
    from torchgpu.train.observe.tensorboard import TB_DIR

    out = tmp_path / "run"
    done = run_cli(["train", "--example", "housing", "--data-size", "123", "--epochs", "2",
                    "--batch-size", "13", *STAGES, "--profile", "2", "--log", "tensorboard",
                    "--estimate-memory", "--out", str(out)], timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    # the profile: rank 0's trace, with its stage's forward (annotated) and backward
    trace = json.loads((out / "profile.trace.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert "torchgpu::forward" in names
    assert any(n.startswith("autograd::engine::evaluate_function") for n in names)
    assert summary["profile"]["steps"] == 2 and summary["profile"]["shares"]["forward"] > 0
    # TensorBoard: the step losses metrics.jsonl holds
    scalars = _scalars(out / TB_DIR)
    steps = [(r["step"], r["loss"]) for r in _lines(out, "step")]
    assert [s for s, _ in scalars["train/loss"]] == [s for s, _ in steps]
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([v for _, v in steps],
                                                                  rel=1e-6)
    # the estimate beside each stage's measured peak
    # the estimate of each stage (the run's cut) beside that stage's measured peak
    estimate = summary["memory_estimate"]
    assert estimate["source"] == "estimate_memory" and estimate["devices"] == ["cpu", "cpu"]
    assert [d["estimated_peak_bytes"] for d in summary["devices"]] == \
        estimate["per_device_bytes"]
    # config.toml records the cut the run made
    assert 'balance = "3,2"' in (out / "config.toml").read_text()


@pytest.mark.parametrize(("spec", "needle"), [
    (["--model", "tests.user_models:lm_factory", "--data", "tests.user_models:lm_data"],
     "but the data yields dict batches"),
    (["--model", "tests.user_models:cnn_factory", "--data", "tests.user_models:cnn_data",
      "--loss", "cross_entropy"], "BNConvNet is not an nn.Sequential")])
def test_a_model_it_cannot_cut_is_refused_before_workers_start(
        tmp_path: Path, spec: list[str], needle: str) -> None:
    out = tmp_path / "run"
    done = run_cli(["train", *spec, *STAGES, "--epochs", "1", "--batch-size", "8",
                    "--out", str(out)])
    assert done.returncode == 2, done.stderr[-3000:]
    # once: the launcher's; no worker started (each would have said it too)
    assert done.stderr.count(needle) == 1, done.stderr
    assert "worker" not in done.stderr and "Traceback" not in done.stderr
    assert not out.exists()


@pytest.fixture
def gloo_world_of_one(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("gloo_world_of_one")
def test_optimizer_state_is_keyed_by_parameter_and_fits_another_cut() -> None:
    """Saved from one cut (all layers on one stage), restored into two other stages: each
    parameter gets its own moments back, and a step from there equals the uncut one."""
    from torchgpu.train.strategies.stages.state import StageOptimizers

    model = dropout_bn().eval()
    layers = list(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    x = torch.randn(16, 6)
    for _ in range(3):
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
    whole = StageOptimizers(optimizer, model, layers)
    whole.gather()
    saved = whole.state_dict()

    again = dropout_bn().eval()
    again.load_state_dict(model.state_dict())
    cuts = [list(again)[:5], list(again)[5:]]
    optimizers = [torch.optim.AdamW([p for m in cut for p in m.parameters()], lr=0.5)
                  for cut in cuts]
    for opt, cut in zip(optimizers, cuts, strict=True):
        StageOptimizers(opt, again, cut).load_state_dict(saved)
        assert opt.param_groups[0]["lr"] == 0.01  # the saved hyperparameters
    names = dict(again.named_parameters())
    restored = {n: st for opt in optimizers for p, st in opt.state.items()
                for n, q in names.items() if q is p}
    for name, p in model.named_parameters():
        torch.testing.assert_close(restored[name]["exp_avg"], optimizer.state[p]["exp_avg"],
                                   rtol=0, atol=0)
    for net, opts in ((model, [optimizer]), (again, optimizers)):
        for opt in opts:
            opt.zero_grad()
        net(x).pow(2).mean().backward()
        for opt in opts:
            opt.step()
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name


def test_a_checkpoint_of_another_model_or_strategy_is_refused() -> None:
    from torchgpu.train.strategies.stages.state import StageOptimizers

    model = nn.Sequential(nn.Linear(2, 2))
    opt = torch.optim.Adam(model.parameters())
    stage = StageOptimizers(opt, model, list(model))
    with pytest.raises(ValueError, match="not the optimizer state of a multi-process"):
        stage.load_state_dict(opt.state_dict())
    with pytest.raises(ValueError, match=r"no optimizer state for 0\.weight, 0\.bias"):
        stage.load_state_dict({"format": "torchgpu.stage-optimizers/1", "params": {}})


def test_a_hang_in_a_stage_step_names_that_step() -> None:
    """The stage pipeline's heartbeat phase ("stages") is a step in progress, as DDP's
    "training" is: the paragraph says "of step N + 1" and where the missing rank was."""
    from torchgpu.launch.hang_watch import diagnose

    now = time.time()
    beats = {
        0: {"rank": 0, "world_size": 2, "step": 2, "phase": "stages", "time": now,
            "progress_at": now - 4, "failure": {"kind": "timeout", "phase": "stages",
                                                "step": 2, "at": now, "timeout_s": 3,
                                                "error": "Timed out waiting 3000ms"}},
        1: {"rank": 1, "world_size": 2, "step": 2, "phase": "stages", "time": now,
            "progress_at": now - 4, "failure": None},
    }
    text = diagnose(beats, now=now)
    assert text is not None
    assert ("rank(s) 0 waited for 3 s in the stages' sends and receives of step 3, which "
            "rank(s) 1 did not reach") in text
    assert "rank 1: in step 3 (its stages' forward/backward, sends and receives)" in text


class _Task:
    """What StageTrainer reads of a run's Task: the loss, metrics, samples, optimizer."""

    def __init__(self) -> None:
        from tests.stage_models import regression

        self.train, _ = regression()
        self.metrics: dict[str, Any] = {}

    @staticmethod
    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output, target)

    def sample(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.train.tensors  # type: ignore[attr-defined]
        return x[:rows], y[:rows]

    def make_optimizer(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=lr)


@pytest.mark.usefixtures("gloo_world_of_one")
@pytest.mark.parametrize("checkpointing", [False, True])
def test_activation_checkpointing_recomputes_inside_each_stage(checkpointing: bool) -> None:
    """--activation-checkpointing reaches the stages (they run their layers, not the
    model's forward): a stage's first layer runs again in backward, with the same
    gradients as without it."""
    from torchgpu.precision import Precision
    from torchgpu.train.config import TrainConfig
    from torchgpu.train.strategies.stages.trainer import StageTrainer

    model = dropout_bn().eval()  # eval: dropout and BatchNorm draw and update nothing
    calls: list[int] = []
    model[0].register_forward_hook(lambda *_: calls.append(1))
    config = TrainConfig(strategy="pipeline", batch_size=8, lr=0.1, chunks=1,
                         activation_checkpointing=checkpointing)
    trainer = StageTrainer(model, config, torch.device("cpu"), _Task(),
                           Precision("fp32", "cpu"))
    # The stages train (checkpointing recomputes only in training mode), their dropout
    # and BatchNorm layers stay in eval.
    trainer.pipe.train(True)
    for layer in model:
        if isinstance(layer, (nn.Dropout, nn.BatchNorm1d)):
            layer.eval()
    x, y = _Task().sample(8)
    trainer.pipe.step(x, y, rows=8, weight=8)  # the first: torch's stage infers shapes too
    trainer.optimizer.zero_grad()
    calls.clear()
    trainer.pipe.step(x, y, rows=8, weight=8)
    assert len(calls) == (2 if checkpointing else 1)
    grad = model[0].weight.grad
    assert grad is not None
    reference = dropout_bn().eval()
    (nn.functional.mse_loss(reference(x), y) * 8).backward()
    assert torch.equal(grad, reference[0].weight.grad)


@pytest.mark.usefixtures("gloo_world_of_one")
def test_a_new_stage_s_shape_inference_draws_no_random_numbers() -> None:
    """A stage built mid-run (a new batch shape, or the first step after a resume) infers
    its shapes with one forward of its module; that forward must not draw dropout masks
    (torch 2.11 did not fork the RNG around it), or a resumed run's masks shift: the first
    real step gets the masks a plain forward right after the same seed gets."""
    from torchgpu.parallel.stages import StagePipeline

    x, y = _Task().sample(8)
    model, reference = dropout_bn(), dropout_bn()
    pipe = StagePipeline(model, device="cpu", loss_fn=nn.functional.mse_loss, chunks=1)
    torch.manual_seed(5)
    pipe.step(x, y)
    torch.manual_seed(5)
    nn.functional.mse_loss(reference(x), y).backward()
    for (name, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert a.grad is not None and torch.equal(a.grad, b.grad), name
