"""A run's ``--activation-checkpointing [CLASS]``: the block class named by its name.

``torchgpu train --activation-checkpointing`` and ``fit(activation_checkpointing=True)``
checkpoint the model's auto-detected repeated block
(:func:`~torchgpu.memory.repeated_blocks.find_repeated_blocks`);
``--activation-checkpointing T5Block`` / ``fit(activation_checkpointing="T5Block")``
name the block class instead, for a model where the detection finds none (a CNN with
no repeated block) or the wrong one. :func:`checkpoint_for_run` applies either.
"""

from __future__ import annotations

from torch import nn

from torchgpu.errors import ConfigError
from torchgpu.memory.activation_checkpointing import (
    apply_activation_checkpointing,
    checkpointing_report,
)
from torchgpu.memory.repeated_blocks import composite_classes
from torchgpu.parallel.data import unwrap


def blocks_named(model: nn.Module, name: str) -> tuple[type, ...]:
    """The module classes in ``model`` called ``name`` (``T5Block``, or qualified,
    ``transformers.models.t5.modeling_t5.T5Block``). Raises ConfigError when there is
    none, listing the classes it could name."""
    found: dict[type, None] = {}
    for module in unwrap(model).modules():
        cls = type(module)
        if name in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}"):
            found[cls] = None
    if not found:
        classes = composite_classes(model)
        listed = ", ".join(classes) or "none (it has no nested modules)"
        example = classes[0].split(" ")[0] if classes else "MyBlock"
        raise ConfigError(
            f"--activation-checkpointing {name}: {type(unwrap(model)).__name__} has no "
            f"module of class {name!r}. Its classes with layers of their own (repeated ones "
            f"first): {listed}. Name one of them, e.g. --activation-checkpointing "
            f"{example} (fit: "
            "activation_checkpointing=\"CLASS\"), or give the bare flag to detect the "
            "repeated block.")
    return tuple(found)


def checkpoint_for_run(model: nn.Module, setting: bool | str) -> str:
    """Apply a run's activation checkpointing to ``model`` in place: ``True`` checkpoints
    the detected repeated block (or a sequential model's segments), a class name that
    class's modules. Returns the line for the console. Raises ConfigError for a name the
    model lacks or a model with nothing to detect, saying what to name."""
    if isinstance(setting, str):
        apply_activation_checkpointing(model, blocks=blocks_named(model, setting))
    else:
        apply_activation_checkpointing(model)
    return checkpointing_report(model).describe()
