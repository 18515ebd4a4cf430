"""TrainConfig: validation table, defaults, and the flags a relaunched worker gets."""

from __future__ import annotations

import dataclasses
import datetime

import pytest

from torchgpu.cli.train import worker_argv
from torchgpu.cli.train_flags import config_from_argv
from torchgpu.errors import ConfigError, TorchGpuError, UsageError
from torchgpu.train.config import EXAMPLE_DEFAULTS, TrainConfig, resolve
from torchgpu.train.config_checks import validate

BAD = [
    (TrainConfig(example="mnist"), ConfigError, "mnist"),
    (TrainConfig(strategy="zero3"), ConfigError, "zero3"),
    (TrainConfig(precision="fp8"), ConfigError, "fp8"),
    (TrainConfig(on_nonfinite="ignore"), ConfigError, "ignore"),
    (TrainConfig(progress="tqdm"), ConfigError, "tqdm"),
    (TrainConfig(nproc=0), ConfigError, "--nproc 0"),
    (TrainConfig(epochs=0), ConfigError, "--epochs 0"),
    (TrainConfig(batch_size=-1), ConfigError, "--batch-size -1"),
    (TrainConfig(accumulate=0), ConfigError, "--accumulate 0"),
    (TrainConfig(num_workers=-2), ConfigError, "--num-workers -2"),
    (TrainConfig(lr=0.0), ConfigError, "--lr 0.0"),
    (TrainConfig(clip_norm=-1.0), ConfigError, "--clip-norm"),
    (TrainConfig(save_every=0), ConfigError, "--save-every 0"),
    (TrainConfig(resume=""), UsageError, "--out RUN_DIR"),
    (TrainConfig(keep_last=2), UsageError, "--save-every"),
    (TrainConfig(example="housing", data="x.csv", target="y"), UsageError, "both"),
    (TrainConfig(data="x.csv"), UsageError, "--target"),
    (TrainConfig(target="price"), UsageError, "--data"),
    (TrainConfig(nnodes=2), UsageError, "--rdzv-endpoint"),
    (TrainConfig(nnodes=2, node_rank=2, rdzv_endpoint="h:1"), UsageError, "--node-rank 2"),
    (TrainConfig(rdzv_endpoint="no-port"), UsageError, "HOST:PORT"),
    (TrainConfig(chunks=4), UsageError, "pipeline"),
]


@pytest.mark.parametrize(("config", "kind", "needle"), BAD)
def test_bad_values_are_refused_with_one_paragraph(
    config: TrainConfig, kind: type[TorchGpuError], needle: str
) -> None:
    with pytest.raises(kind) as info:
        validate(config)
    message = str(info.value)
    assert needle in message
    assert "\n" not in message
    assert info.value.exit_code == 2


def test_good_config_passes_and_resolve_fills_defaults() -> None:
    config = TrainConfig()
    validate(config)
    now = datetime.datetime(2024, 5, 6, 7, 8, 9)
    resolved = resolve(config, now)
    defaults = EXAMPLE_DEFAULTS["housing"]
    assert resolved.example == "housing"
    assert (resolved.epochs, resolved.batch_size, resolved.lr) == (
        defaults.epochs, defaults.batch_size, defaults.lr)
    assert resolved.out == "runs/housing-20240506-070809"
    explicit = resolve(TrainConfig(example="lenet", epochs=5, out="o"), now)
    assert (explicit.epochs, explicit.out) == (5, "o")
    assert explicit.batch_size == EXAMPLE_DEFAULTS["lenet"].batch_size


def test_csv_run_is_named_after_the_file() -> None:
    resolved = resolve(TrainConfig(data="/data/prices.csv", target="y"),
                       datetime.datetime(2024, 1, 2, 3, 4, 5))
    assert resolved.example is None
    assert resolved.out == "runs/prices-20240102-030405"


def test_cli_flags_map_onto_every_field() -> None:
    config = config_from_argv([
        "--example", "lenet", "--device", "cpu", "--strategy", "ddp", "--accumulate", "3",
        "--activation-checkpointing", "--precision", "bf16", "--epochs", "2",
        "--batch-size", "7", "--lr", "0.5", "--seed", "9", "--out", "d", "--resume",
        "--on-nonfinite", "skip", "--nproc", "2", "--max-restarts", "1",
    ])
    assert config.accumulate == 3 and config.activation_checkpointing
    assert (config.precision, config.epochs, config.batch_size, config.lr) == ("bf16", 2, 7, 0.5)
    assert config.resume == "" and config.on_nonfinite == "skip"
    assert (config.nproc, config.max_restarts, config.seed) == (2, 1, 9)


def test_worker_argv_round_trips_without_launcher_flags() -> None:
    config = resolve(TrainConfig(example="housing", nproc=2, strategy="ddp", accumulate=2,
                                 activation_checkpointing=True, gpus="0,1",
                                 max_restarts=3, out="runs/x"))
    argv = worker_argv(config)
    assert "--nproc" not in argv and "--gpus" not in argv and "--max-restarts" not in argv
    back = config_from_argv(argv)
    expected = dataclasses.replace(config, nproc=None, gpus=None, max_restarts=0)
    assert back == expected


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"seed": -1}, "--seed -1 is out of range"),
        ({"seed": 2**63}, "between 0 and 9223372036854775807"),
        ({"seed": 2**70}, "--seed 1180591620717411303424"),
        ({"batch_size": 2**63}, "--batch-size 9223372036854775808 is out of range"),
        ({"batch_size": 2**31 + 1}, "must be <= 2147483648"),
        ({"data_size": 10**20}, "--data-size"),
        ({"epochs": 2**40}, "--epochs"),
        ({"accumulate": 2**40}, "--accumulate"),
        ({"strategy": "pipeline", "chunks": 2**40}, "--chunks"),
        ({"num_workers": 100_000}, "--num-workers 100000 would start"),
        ({"gpus": "0,,1"}, "--gpus '0,,1' is not a GPU list"),
        ({"gpus": "0,0"}, "--gpus '0,0'"),
        ({"gpus": "1,-1"}, "--gpus '1,-1'"),
    ],
)
def test_out_of_range_values_are_refused(changes: dict[str, object], needle: str) -> None:
    with pytest.raises(TorchGpuError) as error:
        validate(TrainConfig(**changes))  # type: ignore[arg-type]
    assert needle in str(error.value)
    assert error.value.exit_code == 2
    assert "CUDA_VISIBLE_DEVICES" not in str(error.value)


@pytest.mark.parametrize("seed", [0, 1, 2**63 - 1])
def test_seeds_in_range_pass(seed: int) -> None:
    validate(TrainConfig(seed=seed, batch_size=2**31, gpus="0,1"))
