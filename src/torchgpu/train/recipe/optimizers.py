"""The run's optimizer: ``--optimizer adam|adamw|sgd|module:function`` and ``fit(optimizer=)``.

A choice is a built-in name, at the run's ``--lr`` (``adam``: the built-in examples'
default; ``adamw``: the default for a user's model; plain ``sgd``), or a function
``params -> torch.optim.Optimizer`` (``fit(optimizer=...)`` or a ``module:function`` spec,
:func:`resolve`) that sets its own learning rate; a spec naming an Optimizer class gets
``lr=--lr``. A Task carries its default choice; ``--optimizer`` replaces it. A built-in name
gets the fused kernel on CUDA (one kernel for every parameter) and torch's default
elsewhere, which keeps CPU runs bitwise equal to a hand-written ``torch.optim.AdamW(params, lr)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchgpu.errors import ConfigError, TorchGpuError, UsageError, first_line
from torchgpu.train.config import OPTIMIZER_NAMES as OPTIMIZER_NAMES

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
#: A built-in name or a factory (see the module docstring).
OptimizerChoice = str | OptimizerFactory

_BUILT_IN: dict[str, Any] = {  # name -> class taking (params, lr=)
    "adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


def check_name(value: str) -> None:
    """Raise ConfigError unless ``value`` is a built-in name or looks like a
    ``module:function`` spec (whether the spec resolves is checked by :func:`resolve`)."""
    if value in OPTIMIZER_NAMES or ":" in value.strip(":"):
        return
    raise ConfigError(
        f"unknown optimizer {value!r}: allowed are {', '.join(OPTIMIZER_NAMES)} (at --lr), or "
        "a module:function spec naming a function params -> torch.optim.Optimizer. Pass one "
        "of them with --optimizer, e.g. --optimizer adam or --optimizer mypkg.optim:make."
    )


def resolve(value: str) -> OptimizerChoice:
    """``value`` as a choice: a built-in name as it is, a spec resolved to its function
    or Optimizer class. ConfigError for neither (:func:`check_name`), UsageError (exit 2)
    for a spec that does not resolve or is not callable."""
    check_name(value)
    if value in OPTIMIZER_NAMES:
        return value
    from torchgpu.factories import resolve_callable

    found: OptimizerFactory = resolve_callable(value, "optimizer")
    return found


def kernel_options(params: list[nn.Parameter]) -> dict[str, bool]:
    """Keyword arguments for a built-in optimizer over ``params``: ``{"fused": True}`` when
    every parameter is a floating-point tensor on one CUDA device (torch's fused Adam,
    AdamW and SGD kernels), else none (torch's default)."""
    devices = {p.device for p in params}
    if (len(devices) == 1 and next(iter(devices)).type == "cuda"
            and all(p.is_floating_point() for p in params)):
        return {"fused": True}
    return {}


def make(choice: OptimizerChoice, params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """The optimizer ``choice`` makes over ``params`` (a name or class at ``lr``).

    Raises UsageError when a factory fails or returns something that is not an Optimizer.
    """
    if isinstance(choice, str):
        built: torch.optim.Optimizer = _BUILT_IN[choice](params, lr=lr,
                                                         **kernel_options(params))
        return built
    made: Any
    factory: Any = choice
    name = getattr(choice, "__qualname__", type(choice).__name__)
    try:
        if isinstance(choice, type) and issubclass(choice, torch.optim.Optimizer):
            made = factory(params, lr=lr)  # --optimizer torch.optim:RAdam names a class
        else:
            made = factory(params)
    except TorchGpuError:
        raise
    except Exception as error:
        raise UsageError(
            f"the optimizer factory {name} failed on the model's parameters "
            f"({type(error).__name__}: {first_line(error)}): it must take the list of "
            "parameters and return a torch.optim.Optimizer, e.g. "
            "lambda params: torch.optim.SGD(params, lr=0.1)"
        ) from None
    if not isinstance(made, torch.optim.Optimizer):
        raise UsageError(
            f"the optimizer factory {name} returned a {type(made).__name__}, not a "
            "torch.optim.Optimizer: pass a function params -> Optimizer, e.g. "
            "lambda params: torch.optim.SGD(params, lr=0.1)"
        )
    return made


def planned_name(choice: OptimizerChoice) -> str:
    """The optimizer the memory planner assumes: the built-in name, else ``adam`` (two
    state tensors per parameter, as most optimizers keep at most)."""
    return choice if isinstance(choice, str) else "adam"
