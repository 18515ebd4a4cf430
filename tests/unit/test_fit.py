"""torchgpu.fit on users' models: dict batches with the model's own .loss and tied
embeddings, pairs with a user loss, BatchNorm, metrics, exact accumulation, bitwise
stop-and-resume, --batch-size auto keeping the effective batch, and bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

from tests.step_limit import train_until
from tests.user_models import (
    BNConvNet,
    CNNDictWrapper,
    DictImageDataset,
    ImageDataset,
    InPlaceToLinear,
    TinyCausalLM,
    TokenDataset,
    cnn_dict_loss,
    lm_factory,
    sgd,
)
from torchgpu import fit
from torchgpu.errors import DataError, UsageError
from torchgpu.train.config import TrainConfig
from torchgpu.train.task import user_task


def _token_accuracy(out: Any, batch: dict[str, torch.Tensor]) -> float:
    hits = out.logits[:, :-1].argmax(-1) == batch["labels"][:, 1:]
    return float(hits.float().mean())


def _quiet(**kw: Any) -> dict[str, Any]:
    return {"progress": "off", **kw}


def test_causal_lm_with_dict_batches_trains_and_keeps_tied_weights(tmp_path: Path) -> None:
    result = fit(lm_factory, TokenDataset(64), eval_data=TokenDataset(16, seed=1),
                 metrics={"token_accuracy": _token_accuracy}, epochs=3, batch_size=8, lr=3e-3,
                 out=tmp_path / "run", **_quiet())
    summary = result.summary
    assert summary["steps"] == 3 * 8 and summary["batch_size"] == 8
    assert summary["global_batch"] == 8
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert summary["final"]["train_loss"] < first["loss"]  # it learned something
    assert 0.0 <= summary["final"]["test_token_accuracy"] <= 1.0
    model = result.model
    assert isinstance(model, TinyCausalLM)
    assert model.head.weight is model.embed.weight  # still tied after training
    for name in ("summary.json", "metrics.jsonl", "model.safetensors", "loss.png"):
        assert (tmp_path / "run" / name).is_file()
    # The run leaves no hook behind: the model is called as the user calls it.
    batch = {"input_ids": TokenDataset(2).ids, "labels": TokenDataset(2).ids}
    assert not model._forward_pre_hooks
    assert model(**batch).loss is not None


def test_saved_weights_load_back_into_a_fresh_model(tmp_path: Path) -> None:
    result = fit(lm_factory, TokenDataset(32), epochs=1, batch_size=8, out=tmp_path / "run",
                 **_quiet())
    state = load_file(tmp_path / "run" / "model.safetensors")
    assert "embed.weight" in state and "head.weight" not in state  # tied: stored once
    fresh = TinyCausalLM()
    from torchgpu import load_state_dict

    load_state_dict(fresh, tmp_path / "run" / "model.safetensors")  # re-tied on load
    assert fresh.head.weight is fresh.embed.weight
    for key, value in result.model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value.cpu()), key


def test_pairs_with_batchnorm_and_a_user_loss(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = BNConvNet()
    before = model.stem[1].running_mean.clone()
    result = fit(model, ImageDataset(48), eval_data=ImageDataset(16, seed=1),
                 loss=nn.CrossEntropyLoss(), epochs=2, batch_size=8,
                 metrics={"accuracy": lambda out, y: float((out.argmax(1) == y).float().mean())},
                 out=tmp_path / "run", **_quiet())
    assert result.model is model  # an nn.Module is trained in place
    assert not torch.equal(model.stem[1].running_mean, before)  # BatchNorm statistics moved
    assert result.summary["final"]["test_accuracy"] is not None
    assert result.summary["steps"] == 2 * 6


def test_dict_batches_with_a_user_loss_and_batchnorm(tmp_path: Path) -> None:
    result = fit(CNNDictWrapper, DictImageDataset(48), eval_data=DictImageDataset(16, seed=1),
                 loss=cnn_dict_loss, epochs=1, batch_size=16, out=tmp_path / "run", **_quiet())
    assert result.summary["steps"] == 3
    assert result.summary["final"]["test_loss"] is not None


def test_accumulation_equals_the_big_batch_on_dict_batches(tmp_path: Path) -> None:
    def no_dropout() -> TinyCausalLM:
        return TinyCausalLM(dropout=0.0)

    def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        # SGD: Adam's update divides by sqrt(v), which magnifies float rounding on tiny
        # gradients, so exactness is checked where the update is linear in the gradient.
        return torch.optim.SGD(params, lr=0.5)

    big = fit(no_dropout, TokenDataset(48), epochs=1, batch_size=16, out=tmp_path / "a",
              optimizer=sgd, **_quiet())
    acc = fit(no_dropout, TokenDataset(48), epochs=1, batch_size=4, accumulate=4,
              out=tmp_path / "b", optimizer=sgd, **_quiet())
    assert acc.summary["global_batch"] == big.summary["global_batch"] == 16
    for (name, a), b in zip(big.model.state_dict().items(), acc.model.state_dict().values(),
                            strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_stop_and_resume_is_bitwise_on_dict_batches(tmp_path: Path) -> None:
    settings = {"epochs": 2, "batch_size": 8, "seed": 3, "progress": "off", "save_every": 3}
    whole = fit(lm_factory, TokenDataset(40), out=tmp_path / "whole", **settings)
    # The same run stopped after step 4 (mid-epoch), then resumed in a new call.
    task = user_task(lm_factory, TokenDataset(40), name="lm_factory")
    config = TrainConfig(model="fit:lm_factory", data="fit:TokenDataset",
                         out=str(tmp_path / "cut"), **settings)
    stopped = train_until(4, config, task=task)
    assert stopped.summary["steps"] == 4 and stopped.summary["stopped_early"]
    resumed = fit(lm_factory, TokenDataset(40), out=tmp_path / "cut", resume=True, **settings)
    assert resumed.summary["steps"] == whole.summary["steps"]
    for (name, a), b in zip(whole.model.state_dict().items(),
                            resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_auto_batch_size_keeps_the_effective_batch(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHGPU_SIMULATE_MEMORY_LIMIT_SAMPLES", "6")
    result = fit(lm_factory, TokenDataset(64), epochs=1, batch_size="auto",
                 effective_batch_size=16, out=tmp_path / "run", **_quiet())
    micro, acc = result.summary["batch_size"], result.summary["accumulate"]
    assert micro <= 6 and micro * acc == 16 == result.summary["global_batch"]


def test_optimizer_factory_is_used(tmp_path: Path) -> None:
    seen: list[torch.optim.Optimizer] = []

    def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        seen.append(torch.optim.SGD(params, lr=0.0))
        return seen[-1]

    torch.manual_seed(0)
    model = TinyCausalLM(dropout=0.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fit(model, TokenDataset(16), optimizer=sgd, epochs=1, batch_size=8, out=tmp_path / "r",
        **_quiet())
    assert len(seen) == 1
    for key, value in model.state_dict().items():  # lr 0: nothing moved
        assert torch.equal(value, before[key]), key


@pytest.mark.parametrize("strategy", ["single", "dp"])
def test_a_model_whose_to_returns_nothing_is_kept(tmp_path: Path, strategy: str) -> None:
    torch.manual_seed(0)
    model = InPlaceToLinear(3, 1)
    data = TensorDataset(torch.randn(8, 3), torch.randn(8, 1))
    before = model.weight.detach().clone()
    result = fit(model, data, loss=nn.MSELoss(), optimizer=sgd, strategy=strategy, epochs=1,
                 batch_size=4, out=tmp_path / "run", **_quiet())
    assert result.summary["strategy"] == strategy
    assert not torch.equal(model.weight.detach(), before)  # the user's module was trained


class _Stream(IterableDataset[Any]):
    def __iter__(self) -> Any:
        yield from ()


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"train_data": _Stream()}, DataError, "a stream that yields no items"),
    ({"train_data": [1, 2, 3]}, DataError, "items of type int"),
    ({"train_data": nn.Linear(2, 2)}, DataError, "is a model"),
    ({"train_data": TensorDataset(torch.zeros(0, 2), torch.zeros(0))}, DataError, "empty"),
    ({"train_data": ImageDataset(8)}, UsageError, "no loss was given"),
    ({"train_data": TokenDataset(8), "nproc": 2}, UsageError, "unknown setting"),
    ({"train_data": TokenDataset(8), "batch_size": 0}, Exception, "batch"),
])
def test_bad_input_is_refused_before_anything_is_written(
        tmp_path: Path, kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    train_data = kwargs.pop("train_data")
    with pytest.raises(error, match=match):
        fit(lm_factory, train_data, out=tmp_path / "run", **_quiet(), **kwargs)
    assert not (tmp_path / "run").exists()


def test_a_factory_that_returns_no_module_is_named(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="returned a dict"):
        fit(lambda: {}, TokenDataset(8), out=tmp_path / "run", **_quiet())
    assert not (tmp_path / "run").exists()


def test_model_and_pipeline_refuse_a_model_they_cannot_cut(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="dict batches"):
        fit(lm_factory, TokenDataset(16), strategy="pipeline", devices="cpu,cpu",
            out=tmp_path / "a", **_quiet())
    with pytest.raises(UsageError, match=r"not an nn\.Sequential"):
        fit(BNConvNet, ImageDataset(16), loss=nn.CrossEntropyLoss(), strategy="model",
            devices="cpu,cpu", out=tmp_path / "b", **_quiet())


def test_a_user_sequential_runs_as_a_pipeline(tmp_path: Path) -> None:
    def mlp() -> nn.Sequential:
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                             nn.Linear(8, 1))

    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    data = TensorDataset(x, x.sum(1, keepdim=True))
    single = fit(mlp, data, loss=nn.MSELoss(), epochs=1, batch_size=8, out=tmp_path / "s",
                 strategy="single", **_quiet())
    piped = fit(mlp, data, loss=nn.MSELoss(), epochs=1, batch_size=8, out=tmp_path / "p",
                strategy="pipeline", devices="cpu,cpu", chunks=2, **_quiet())
    for (name, a), b in zip(single.model.state_dict().items(),
                            piped.model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_activation_checkpointing_finds_the_blocks_and_keeps_the_weights(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    settings = {"epochs": 1, "batch_size": 8, "seed": 5, "progress": "off"}
    plain = fit(lm_factory, TokenDataset(32), out=tmp_path / "plain", **settings)
    ckpt = fit(lm_factory, TokenDataset(32), out=tmp_path / "ckpt",
               activation_checkpointing=True, **settings)
    assert "3 x Block recomputed in backward" in capsys.readouterr().err
    assert plain.model.state_dict().keys() == ckpt.model.state_dict().keys()
    for (name, a), b in zip(plain.model.state_dict().items(), ckpt.model.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name  # dropout included: the recompute replays its RNG


def _oom_above(limit: int, seen: list[int]) -> Any:
    """A forward pre-hook: ``torch.OutOfMemoryError`` for a training batch of more than
    ``limit`` rows, as a device of that size would raise."""
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not (module.training and torch.is_grad_enabled()):  # not evaluation, not probe
            return
        rows = int(kwargs["input_ids"].shape[0])  # called as model(**batch)
        seen.append(rows)
        if rows > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {rows} rows")

    return hook


def test_oom_backoff_on_dict_batches_equals_the_smaller_batch(tmp_path: Path) -> None:
    def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.5)

    seen: list[int] = []

    def limited() -> TinyCausalLM:
        model = TinyCausalLM(dropout=0.0)
        model.register_forward_pre_hook(_oom_above(4, seen), with_kwargs=True)
        return model

    backed = fit(limited, TokenDataset(32), epochs=1, batch_size=16, optimizer=sgd,
                 out=tmp_path / "a", **_quiet())
    small = fit(lambda: TinyCausalLM(dropout=0.0), TokenDataset(32), epochs=1, batch_size=4,
                accumulate=4, optimizer=sgd, out=tmp_path / "b", **_quiet())
    assert seen[:2] == [16, 8] and max(seen[2:]) == 4  # halved until it fits
    assert len(backed.summary["oom_backoffs"]) == 2
    for (name, a), b in zip(small.model.state_dict().items(),
                            backed.model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_a_nan_loss_on_dict_batches_stops_or_is_skipped(tmp_path: Path) -> None:
    from torchgpu.errors import NonFiniteLossError

    def poisoned() -> TinyCausalLM:
        model = TinyCausalLM()
        calls = {"n": 0}

        def hook(module: nn.Module, args: Any, kwargs: dict[str, Any], out: Any) -> Any:
            if module.training and torch.is_grad_enabled():  # steps, not the probe
                calls["n"] += 1
                if calls["n"] == 3:
                    out.loss = out.loss * float("nan")
            return out

        model.register_forward_hook(hook, with_kwargs=True)
        return model

    with pytest.raises(NonFiniteLossError, match="step 3"):
        fit(poisoned, TokenDataset(32), epochs=1, batch_size=8, out=tmp_path / "stop",
            **_quiet())
    skipped = fit(poisoned, TokenDataset(32), epochs=1, batch_size=8, on_nonfinite="skip",
                  out=tmp_path / "skip", **_quiet())
    assert skipped.summary["skipped_steps"] == 1 and skipped.summary["steps"] == 3
    assert all(torch.isfinite(p).all() for p in skipped.model.parameters())


def test_bf16_autocast_on_dict_batches(tmp_path: Path) -> None:
    result = fit(lm_factory, TokenDataset(16), eval_data=TokenDataset(8, seed=1), epochs=1,
                 batch_size=8, precision="bf16", out=tmp_path / "run", **_quiet())
    assert result.summary["precision"] == "bf16"
    assert result.summary["final"]["test_loss"] is not None
    assert all(p.dtype == torch.float32 for p in result.model.parameters())  # weights stay fp32


def test_probe_refuses_a_model_without_a_loss_before_anything_is_written(
        tmp_path: Path) -> None:
    from tests.user_models import CNNDictWrapper, cnn_dict_data

    train_ds, eval_ds = cnn_dict_data()
    with pytest.raises(UsageError, match="no scalar loss"):
        fit(CNNDictWrapper, train_ds, eval_data=eval_ds, out=str(tmp_path / "run"),
            progress="off")
    assert not (tmp_path / "run").exists()


def test_probe_leaves_batchnorm_statistics_and_the_random_state_alone() -> None:
    from tests.user_models import cnn_data, cnn_factory
    from torchgpu.train.probe import probe
    from torchgpu.train.task import user_task

    train_ds, _ = cnn_data()
    task = user_task(cnn_factory, train_ds, loss=torch.nn.CrossEntropyLoss())
    model = task.build_model()
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    probe(task, model)
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
