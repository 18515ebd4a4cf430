"""``torchgpu.fit``: the engine of ``torchgpu train`` on the user's own model and data.

``fit(model, train_data, eval_data=..., loss=..., metrics=..., optimizer=..., **settings)``
takes the same settings as the CLI's flags, by the same names (``batch_size="auto"``,
``strategy="auto"``, ``precision="bf16"``, ``save_every``, ``resume``...), builds one
:class:`~torchgpu.train.task.Task` and runs :func:`torchgpu.train.runner.train`.
Under ``torchgpu launch --nproc N script.py`` (or torchrun) every process calls ``fit``
and it trains data-parallel (or with the chosen strategy) with no code change.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import sys
import typing
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from torchgpu.errors import UsageError
from torchgpu.train.config import TrainConfig
from torchgpu.train.fit_settings import SETTINGS, FitSettings, unknown_settings_error
from torchgpu.train.outputs.report import TrainResult
from torchgpu.train.runner import train
from torchgpu.train.task import as_factory, seeded, user_task

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # torch depends on typing_extensions
    from typing_extensions import Unpack


def config_from_settings(settings: Mapping[str, Any], name: str, data_name: str = "data"
                         ) -> TrainConfig:
    """The TrainConfig for ``fit``'s keyword settings (the CLI flags' names).

    ``batch_size="auto"`` searches the micro-batch; ``resume=True`` continues the run in
    ``out``, ``resume="DIR"`` from a run or checkpoint directory. Raises UsageError for a
    name that is not a setting, naming the closest allowed one.
    """
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        raise unknown_settings_error(unknown)
    values = dict(settings)
    if values.get("batch_size") == "auto":
        values["batch_size"], values["auto_batch_size"] = None, True
    if values.get("resume") is True:
        values["resume"] = ""
    elif values.get("resume") is False:
        values["resume"] = None
    if values.get("progress") is None:
        values.pop("progress", None)
    out = values.get("out")
    if isinstance(out, os.PathLike):
        values["out"] = os.fspath(out)
    if isinstance(values.get("resume"), os.PathLike):
        values["resume"] = os.fspath(values["resume"])
    devices = values.get("devices")
    if isinstance(devices, list | tuple) and all(isinstance(d, str) for d in devices):
        values["devices"] = ",".join(devices)  # ["cuda:0", "cuda:1"] as the flag's list
    _check_types(values)
    for key, value in values.items():  # numpy scalars as Python numbers (config.toml)
        if isinstance(value, numbers.Integral) and not isinstance(value, int):
            values[key] = int(value)
        elif isinstance(value, numbers.Real) and not isinstance(value, int | float):
            values[key] = float(value)
    # The config records what trained as spec-shaped labels (never resolved: fit passes
    # the objects); the run's name, runs/<name>-<time>, is the model's.
    return TrainConfig(model=f"fit:{name}", data=f"fit:{data_name}", **values)


_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "True or False",
               type(None): "None"}


def _accepts(kind: Any, value: Any) -> bool:
    """Whether ``value`` fits ``kind`` (int, float, str, bool or None; numpy scalars count
    as numbers, a bool is not a number)."""
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind is int:
        return isinstance(value, numbers.Integral)
    if kind is float:
        return isinstance(value, numbers.Real)
    return isinstance(value, kind)


def _check_types(values: Mapping[str, Any]) -> None:
    """UsageError naming the setting whose value is of a type the flag never takes
    (``epochs="3"``, ``batch_size="big"``, ``activation_checkpointing="yes"``), before
    it meets a comparison or a truth test somewhere in the run."""
    hints = typing.get_type_hints(TrainConfig)
    for name, value in values.items():
        kinds = typing.get_args(hints[name]) or (hints[name],)
        if any(_accepts(kind, value) for kind in kinds):
            continue
        allowed = [_TYPE_WORDS.get(kind, getattr(kind, "__name__", str(kind)))
                   for kind in kinds]
        if name in ("batch_size", "chunks", "num_workers"):
            allowed.insert(1, "'auto'")
        raise UsageError(
            f"fit(): {name}={value!r} is of type {type(value).__name__}, but {name} takes "
            f"{' or '.join(dict.fromkeys(allowed))} (as the --{name.replace('_', '-')} flag "
            "does)."
        )


def _refuse_split_pair(train_data: Any) -> None:
    """A ``(train, eval)`` pair of Datasets is what ``--data`` returns, not what
    ``train_data`` takes: say so, rather than that its "items" are Datasets."""
    from torch.utils.data import Dataset

    if (isinstance(train_data, tuple | list) and len(train_data) == 2
            and isinstance(train_data[0], Dataset)
            and (train_data[1] is None or isinstance(train_data[1], Dataset))):
        kinds = ", ".join(type(d).__name__ for d in train_data)
        raise UsageError(
            f"train_data is a (train, eval) pair of datasets ({kinds}): fit takes them "
            "apart, fit(model, train, eval_data=eval, ...) (a --data spec of "
            "`torchgpu train` may return the pair)."
        )


def fit(
    model: nn.Module | Callable[[], nn.Module],
    train_data: Any,
    *,
    eval_data: Any = None,
    loss: Callable[[Any, Any], Tensor] | None = None,
    metrics: Mapping[str, Any] | None = None,
    optimizer: str | Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
    scheduler: str | Callable[[torch.optim.Optimizer], Any] | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    **settings: Unpack[FitSettings],
) -> TrainResult:
    """Train ``model`` on ``train_data``; return the :class:`TrainResult` (the trained,
    unwrapped model, the summary, per-epoch records and the output directory).

    - ``model``: an ``nn.Module`` (trained in place) or a zero-argument factory (called
      under ``torch.manual_seed(seed)``, so every process builds the same weights).
    - ``train_data`` / ``eval_data``: map-style ``Dataset``s of ``(inputs, target)`` pairs or
      dicts; ``train_data`` may be a stream (an ``IterableDataset``: ``steps_per_epoch``
      optimizer steps per epoch, required without ``len()``; sharded and resumed exactly).
    - pairs: ``loss(model(inputs), target)`` (tuple/list inputs: ``model(*inputs)``); dicts:
      ``model(**batch)``, the loss is ``output.loss`` / ``output["loss"]`` / a scalar output,
      or ``loss(output, batch)`` when ``loss`` is given.
    - ``metrics``: ``{name: metric}`` on ``eval_data`` each epoch, reported as ``test_<name>``:
      ``fn(output, target_or_batch) -> float`` averaged over the samples, or an object with
      ``reset()``/``update(output, target)``/``compute()`` (e.g. a torchmetrics Metric).
    - ``optimizer``: ``params -> Optimizer``, or ``"adam"``/``"adamw"``/``"sgd"`` at ``lr``
      (default AdamW at ``lr``, 1e-3). ``scheduler``: ``optimizer -> LRScheduler`` or a
      ``module:function`` spec, stepped once per optimizer step and checkpointed; or the
      built-in schedules: ``lr_schedule`` (``"constant"``, ``"linear"``, ``"cosine"``,
      ``"step"``), ``warmup_steps``, ``lr_step_size`` (epochs), ``lr_gamma``.
    - ``collate_fn``: ``fn(items) -> batch`` for both datasets (default torch's
      ``default_collate``), returning a dict of tensors or an ``(inputs, target)`` pair, e.g.
      ``DataCollatorWithPadding(tokenizer)``; it must pickle under spawned DataLoader workers.
    - ``settings``: the ``torchgpu train`` flags by name, typed as ``FitSettings`` (a misspelt
      name is a type error, and at run time a UsageError naming the closest one): ``epochs``,
      ``batch_size`` (int or ``"auto"``, per process), ``effective_batch_size`` (samples per
      optimizer step over all processes, kept under any ``launch --nproc N``), ``strategy``
      (``"auto"``, single, dp, ddp, fsdp, model, pipeline), ``devices``, ``chunks``,
      ``accumulate``, ``precision``, ``activation_checkpointing`` (True, or the block
      class's name), ``compile``, ``clip_norm``, ``lr``, ``out``, ``save_every``,
      ``keep_last``, ``async_save`` (fsdp), ``resume`` (``force_resume=True``: although a
      file the run was built from changed since), ``overwrite`` (an ``out`` holding a run's
      files is refused without ``resume`` or it), ``autoresume`` (a finished run in ``out``
      is not trained again: its result is returned), ``log_every`` (step records every N
      steps; default every 10 s), ``seed``, ``device``, ``progress``, ``on_nonfinite``,
      ``collective_timeout``, ``startup_timeout``, ``stop_timeout`` (seconds), ``profile``,
      ``log`` (``"tensorboard"``), ``memory_snapshot``, ``estimate_memory``,
      ``num_workers`` (int or ``"auto"``), ...; each as ``torchgpu train --help`` says.

    The run's ``OUT/config.toml`` says it cannot be re-run with ``torchgpu train --config``
    (the model and data were objects). Bad input raises torchgpu errors (ConfigError,
    UsageError, DataError...) before anything is written."""
    _refuse_split_pair(train_data)
    name = type(model).__name__ if isinstance(model, nn.Module) else getattr(
        model, "__name__", "model")
    if not name.isidentifier():  # "<lambda>": no name for runs/<name>-<time> or messages
        name = "model"
    values: dict[str, Any] = dict(settings)
    if isinstance(optimizer, str):  # a name (or spec): a setting, recorded in config.toml
        values["optimizer"] = optimizer
    if isinstance(scheduler, str):  # a spec: a setting, as --scheduler
        values["scheduler"] = scheduler
    config = config_from_settings(values, name, type(train_data).__name__)
    collate_label = "collate_fn="
    if collate_fn is not None:  # recorded in config.toml as a label, like the model
        collate_name = getattr(collate_fn, "__name__", type(collate_fn).__name__)
        config = dataclasses.replace(config, collate_fn=f"fit:{collate_name}")
        collate_label = f"collate_fn={collate_name}"
    factory = as_factory(model)
    if not isinstance(model, nn.Module):
        factory = seeded(factory, config.seed)
    task = user_task(factory, train_data, eval_data, loss=loss, metrics=metrics, name=name,
                     collate_fn=collate_fn, collate_label=collate_label)
    if optimizer is not None and not isinstance(optimizer, str):
        task = dataclasses.replace(task, optimizer=optimizer)
    if scheduler is not None and not isinstance(scheduler, str):
        if not callable(scheduler):
            raise UsageError(
                f"scheduler={scheduler!r} is a {type(scheduler).__name__}: pass a function "
                "optimizer -> LRScheduler, e.g. lambda optimizer: "
                "torch.optim.lr_scheduler.StepLR(optimizer, step_size=100), or a "
                "module:function spec (a scheduler object cannot be given: it must be built "
                "on the run's optimizer)")
        task = dataclasses.replace(task, scheduler=scheduler)
    return train(config, task=task)
