"""What torch's pipeline stages run for :class:`~torchgpu.parallel.stages.StagePipeline`.

:class:`StageForward` wraps a stage module: its forward in autocast and a profiler mark
when asked, its first output checked (:func:`check_stage_output`), so an output torch
cannot pass between processes is named on the rank that made it. :func:`stage_class` is
torch's ``PipelineStage`` whose shape inference leaves buffers and the random state alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchgpu.errors import MicroBatchTypeError

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage


class StageForward(nn.Module):
    """A stage module as torch's stage runs it: its forward inside ``autocast`` and a
    profiler annotation (either may be None), its first output checked
    (:func:`check_stage_output`). Holds the module itself, so parameters and buffers are
    the stage's own (the state-dict keys gain a prefix, which nothing here reads: weights
    are always read from the stage modules)."""

    def __init__(self, module: nn.Module,
                 autocast: Callable[[], AbstractContextManager[Any]] | None,
                 label: str | None, *, index: int, last: bool) -> None:
        super().__init__()
        self.stage = module
        self._autocast: Callable[[], AbstractContextManager[Any]] = autocast or nullcontext
        self._label = label
        self._index, self._last, self._checked = index, last, False

    def forward(self, *args: Any) -> Any:
        mark: AbstractContextManager[Any] = (
            torch.profiler.record_function(self._label) if self._label else nullcontext())
        with mark, self._autocast():
            out = self.stage(*args)
        if not self._checked:
            check_stage_output(out, self.stage, self._index, self._last)
            self._checked = True
        return out


def check_stage_output(out: object, stage: nn.Module, index: int, last: bool) -> None:
    """Refuse a stage output torch's stages cannot send to the next stage (a tensor or a
    tuple of tensors passes), or, from the last stage, one with no tensor for the loss.

    Caught here, on the rank that ran the stage, the error names the layer and the type;
    left to torch, one rank fails in its shape inference and the other loses its peer.
    """
    tensors = (isinstance(out, torch.Tensor) or (isinstance(out, tuple | list) and out
               and all(isinstance(item, torch.Tensor) for item in out)))
    if tensors or (last and out is not None and not isinstance(out, str | bytes | int | float)):
        return
    children = list(stage.children())
    layer = type(children[-1] if children else stage).__name__
    what = "the last stage" if last else f"stage {index}"
    needs = ("a tensor (or an output holding the tensors the loss reads)" if last
             else "a tensor or a tuple of tensors, which is what passes between processes")
    raise MicroBatchTypeError(
        f"{what} (its last layer {layer}) returned {type(out).__name__}: a stage of the "
        f"multi-process pipeline must return {needs}. Return tensors from that layer, or "
        "move the cut (--balance) so no stage ends on it, or train in one process "
        "(--strategy pipeline without --nproc, or --strategy single)."
    )


@functools.cache
def stage_class() -> type[PipelineStage]:
    """torch's ``PipelineStage``, except that its shape inference leaves the module's
    buffers and the random state as they were: a new stage runs its module once before
    the first micro-batch to learn the shapes (on zeros or on that micro-batch, by torch
    version), which would otherwise add a BatchNorm running-statistics update (and, on
    torch 2.11, dropout draws) per new micro-batch shape. The
    buffers are put back just before the first real micro-batch (not right after the
    forward inference: some torch versions differentiate that forward afterwards)."""
    from torch.distributed.pipelining import PipelineStage

    class BufferKeepingStage(PipelineStage):
        _saved_buffers: list[torch.Tensor] | None = None

        def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
            self._saved_buffers = [b.detach().clone() for b in self.submod.buffers()]
            # The inference forward draws no random numbers either (dropout): torch
            # 2.13 forks the RNG around it, 2.11 does not, and a resumed run builds
            # its stages at another step than the uninterrupted one.
            cuda = [self.device.index or 0] if self.device.type == "cuda" else []
            with torch.random.fork_rng(devices=cuda):
                return super()._prepare_forward_infra(*args, **kwargs)

        def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            if self._saved_buffers is not None:
                with torch.no_grad():
                    for buf, old in zip(self.submod.buffers(), self._saved_buffers,
                                        strict=True):
                        buf.copy_(old)
                self._saved_buffers = None
            return super().forward_one_chunk(*args, **kwargs)

    return BufferKeepingStage
