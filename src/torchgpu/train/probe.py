"""A task checked before anything is written: :func:`probe` runs one forward and loss of
the model on two samples of each split, so a model the data does not fit, a loss that
cannot take its output or carries no gradient, or a model with nothing to train is a
one-paragraph error naming the specs and the fix, not a failure at the first step."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from torchgpu.data.batches import output_loss
from torchgpu.errors import DataError, UsageError
from torchgpu.train.task import Task, untrainable


def probe(task: Task, model: nn.Module, *, model_label: str = "the model",
          data_label: str = "the training data", eval_label: str = "the evaluation data",
          loss_label: str | None = None) -> None:
    """One forward and loss on the first two training samples, and on the first two samples of
    the held-out split (when there is one), before anything is written.

    What would otherwise fail at the first step, after ``--out`` was made (no trainable
    parameters, data the model does not take, a loss that cannot take its output, is no scalar
    or carries no gradient), is a UsageError naming the specs (the ``*_label`` arguments) and
    the fix; a held-out split the model does not take is a DataError naming both splits'
    shapes. The training probe runs in training mode (some models return losses only there)
    without gradients, then the loss on outputs that require them, so a loss that cuts them
    off shows; the held-out probe runs as evaluation does. The CPU random state, the model's
    mode and its buffers are put back."""
    from torchgpu.errors import TorchGpuError, first_line

    if not any(p.requires_grad for p in model.parameters()):
        raise untrainable(model_label, model)
    if loss_label is None:
        loss_label = ("the model's own loss (output.loss)" if task.loss is output_loss
                      else "the loss")
    sample = task.sample(2)
    made_by = f" (batched by {task.collate_label})" if task.collate_fn is not None else ""
    was_training = model.training
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    try:
        try:
            loss, checked = _forward_loss(task, model, sample, evaluating=False)
        except TorchGpuError as error:  # e.g. output_loss: no loss in the output
            raise UsageError(f"{model_label} on two samples of {data_label}{made_by}: "
                             f"{error}") from None
        except Exception as error:
            raise UsageError(
                f"{model_label} on two samples of {data_label}{made_by} failed "
                f"({first_line(error)}): the data's batches must be what the model's forward "
                "takes (pairs: model(inputs), dicts: model(**batch)) and the loss must take "
                "the model's output; check the model and data specs"
                f"{f' and what {task.collate_label} returns' if task.collate_fn else ''}, "
                "or pass the loss that fits."
            ) from None
        _check_scalar(loss, model_label, data_label)
        if checked and not loss.requires_grad:
            from torchgpu.accumulate import NO_GRADIENT

            raise UsageError(f"{loss_label} of {model_label} on {data_label} {NO_GRADIENT}")
        if task.test is None:
            return
        held_out = task.sample(2, "test")
        try:
            float(_forward_loss(task, model, held_out, evaluating=True)[0])
        except Exception as error:
            raise DataError(
                f"{model_label} takes {data_label} ({_shapes(sample, task)}) but fails on two "
                f"samples of {eval_label} ({_shapes(held_out, task)}): {first_line(error)}. "
                "The evaluation after the first epoch of training would fail the same way: "
                "give the evaluation split what the training split has (the same features "
                "or columns, sizes and preprocessing), or fix the data spec."
            ) from None
    finally:
        model.train(was_training)
        with torch.no_grad():
            for name, value in model.named_buffers():
                if name in buffers:
                    value.copy_(buffers[name])


def _forward_loss(task: Task, model: nn.Module, batch: tuple[Any, Any], *,
                  evaluating: bool) -> tuple[Any, bool]:
    """The task's loss of ``model`` on ``batch`` (moved to the model's device), the model
    run without gradients and the CPU random state put back, and whether the loss ran on
    an output that requires gradients (so its own gradient can be checked: see
    :func:`_grad_leaves`); ``evaluating``: in evaluation mode, a tensor output cast to
    float (as evaluation runs it), no gradients at all."""
    from torchgpu.transfer import to_device

    inputs, target = batch
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type != "cpu":  # a user's module already placed: the samples follow it
        inputs, target = to_device((inputs, target), device)
    if evaluating:
        model.eval()
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        if isinstance(inputs, Mapping):
            output = model(**inputs)
        elif isinstance(inputs, tuple | list) and not hasattr(inputs, "_fields"):
            output = model(*inputs)
        else:
            output = model(inputs)
        if evaluating:
            if isinstance(output, Tensor):
                output = output.float()
            return task.loss(output, target), False
        stand_in = _grad_leaves(output)
        with torch.enable_grad():  # the loss (not the model) on an output with gradients
            return task.loss(output if stand_in is None else stand_in, target), \
                stand_in is not None


def _check_scalar(loss: Any, model_label: str, data_label: str) -> None:
    if not (isinstance(loss, Tensor) and loss.numel() == 1 and loss.is_floating_point()):
        shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
        raise UsageError(
            f"the loss of {model_label} on {data_label} is {shape}, not a scalar float "
            "tensor: the loss must return one number per batch (e.g. a mean); pass a "
            "loss that reduces, e.g. torch.nn.CrossEntropyLoss()"
        )


def _grad_leaves(output: Any) -> Any | None:
    """``output`` (a tensor, or tuples, lists and dicts of them) with each floating tensor
    a detached copy that requires a gradient, as the model's output would in a step;
    None when something else is in it (a dataclass, a model-output object): the loss's
    gradient is then not checked, rather than blamed for what the copy could not carry."""
    from torch.utils import _pytree

    leaves, spec = _pytree.tree_flatten(output)
    if not leaves or not all(isinstance(leaf, Tensor) for leaf in leaves):
        return None
    if not any(leaf.is_floating_point() for leaf in leaves):
        return None
    return _pytree.tree_unflatten(
        [leaf.detach().requires_grad_() if leaf.is_floating_point() else leaf
         for leaf in leaves], spec)


def _shapes(batch: tuple[Any, Any], task: Task) -> str:
    """``batch``'s shapes in words: ``inputs (2, 8) and targets (2,)``, or for dict
    batches ``batches {input_ids: (2, 12), labels: (2, 12)}``."""
    def shape(value: Any) -> str:
        if isinstance(value, Tensor):
            return str(tuple(value.shape))
        if isinstance(value, Mapping):
            return "{" + ", ".join(f"{k}: {shape(v)}" for k, v in value.items()) + "}"
        if isinstance(value, tuple | list):
            return "[" + ", ".join(shape(v) for v in value) + "]"
        return type(value).__name__

    inputs, target = batch
    if task.dict_batches:
        return f"batches {shape(inputs)}"
    return f"inputs {shape(inputs)} and targets {shape(target)}"
