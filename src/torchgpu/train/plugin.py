"""The plug-in a TrainConfig names, as the run's :class:`~torchgpu.train.task.Task`.

``--example NAME`` (default housing) and ``--data FILE.csv --target COL`` give a built-in
plug-in; ``--model SPEC --data SPEC [--loss NAME|SPEC]`` the user's model and data, and
``--model SPEC`` on a CSV table the table plug-in with the user's model. ``--metrics`` adds
evaluation metrics and ``--optimizer`` then replaces the plug-in's default optimizer. Every
route gives the same kind of Task and the engine runs them alike: a user plug-in built from
the same pieces as ``--example housing`` (``--optimizer adam``) trains to the same bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from torchgpu.errors import UsageError
from torchgpu.train.config import TrainConfig
from torchgpu.train.recipe import optimizers
from torchgpu.train.task import LOSS_NAMES, LossFn, Task, loss_by_name, seeded, user_task


def task_for_config(config: TrainConfig) -> Task:
    """The Task ``config`` names (resolved config); see the module docstring. Loads the
    data once; the model is built later, by ``task.build_model()`` (seeded by
    ``config.seed``).

    Raises UsageError / DataError (exit 2) for a bad spec, naming it and the fix.
    """
    if config.model is None:
        from torchgpu.examples import task_for

        task = task_for(config)
    else:
        task = _user_plugin(config, config.model)
    if config.metrics:  # --metrics: beside the task's own (the same name: replaced)
        from torchgpu.train.metrics import from_specs

        task = dataclasses.replace(task, metrics={**task.metrics, **from_specs(config.metrics)})
    return with_optimizer(task, config)


def with_optimizer(task: Task, config: TrainConfig) -> Task:
    """``task`` with ``config.optimizer`` (``--optimizer``, checked by validate) as its
    optimizer and ``config.scheduler`` (``--scheduler``) as its scheduler factory when
    given. UsageError for a spec that does not resolve."""
    if config.scheduler is not None:
        from torchgpu.train.schedule import resolve as resolve_scheduler

        task = dataclasses.replace(task, scheduler=resolve_scheduler(config.scheduler))
    if config.optimizer is None:
        return task
    return dataclasses.replace(task, optimizer=optimizers.resolve(config.optimizer))


def _user_plugin(config: TrainConfig, model_spec: str) -> Task:
    from torchgpu.factories import resolve_callable, resolve_data, resolve_model

    def build_user_model() -> nn.Module:
        model: nn.Module = resolve_model(model_spec)
        return model

    loss: LossFn | None = None
    if config.loss is not None:
        loss = (loss_by_name(config.loss) if ":" not in config.loss
                else _checked_loss(resolve_callable(config.loss), config.loss))
    if config.target is not None:  # --model with a CSV table: the table plug-in's data
        from torchgpu.examples import table

        base = table.task(config)
        return dataclasses.replace(base, build_model=seeded(build_user_model, config.seed),
                                   loss=loss or base.loss, optimizer="adamw", trusted=False)
    assert config.data is not None
    train, test = resolve_data(config.data)
    collate = None
    if config.collate_fn is not None:
        from torchgpu.data.collate import resolve_collate

        collate = resolve_collate(config.collate_fn)
    task = user_task(seeded(build_user_model, config.seed), train, test, loss=loss,
                     name=config.run_name, collate_fn=collate,
                     collate_label=f"--collate-fn {config.collate_fn}")
    if task.dict_batches and config.loss in LOSS_NAMES:
        raise UsageError(
            f"--loss {config.loss} takes (output, target) but --data {config.data} yields "
            "dict batches, which have no separate target: drop --loss when the model "
            "computes its loss from the batch's labels (output.loss), or pass "
            "--loss module:function with a function loss(output, batch) -> Tensor"
        )
    return task


def _checked_loss(fn: Any, spec: str) -> LossFn:
    if isinstance(fn, type) and issubclass(fn, nn.Module):
        fn = fn()  # --loss torch.nn:L1Loss names a class: use an instance
    if not callable(fn):
        raise UsageError(
            f"--loss {spec} is a {type(fn).__name__}, not a function: name a function "
            "loss(output, target) -> Tensor (or an nn.Module loss class)"
        )
    loss: LossFn = fn
    return loss
