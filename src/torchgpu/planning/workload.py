"""What a plan is for (:class:`Workload`): the model, data, batch size, precision and
optimizer being planned. The planner's input, read by the choice
(:mod:`~torchgpu.planning.decide`) and by the commands made from it
(:mod:`~torchgpu.planning.commands`), so it lives apart from both."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    """What is being planned, for the command line: a built-in ``example`` or a custom
    ``model`` spec (``module:factory``) with its ``data`` spec when one was given, the
    requested ``batch_size`` (samples per optimizer step), ``precision``, ``optimizer``;
    ``loss``, ``pairs``, ``optimizer_given`` and ``collate_fn`` for the ``torchgpu
    train`` line."""

    batch_size: int
    example: str | None = None
    model: str | None = None
    precision: str = "fp32"
    optimizer: str = "adam"
    data: str | None = None  # the data spec planned with a custom model (--data)
    # What the run line needs besides: the loss spec (--loss), whether the data yields
    # (inputs, target) pairs (then train needs a loss), and whether --optimizer was
    # given (then the run line trains with the optimizer planned, not train's default).
    loss: str | None = None
    pairs: bool = False
    optimizer_given: bool = False
    collate_fn: str | None = None  # the --collate-fn spec batching the data's items
