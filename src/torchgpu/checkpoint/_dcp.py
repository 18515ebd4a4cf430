"""The torch.distributed.checkpoint calls :mod:`torchgpu.checkpoint.sharded` makes, from
the modules that define them (torch 2.11 and later): the package re-exports them without
declaring it, and importing it is heavy, so only sharded checkpoints import this."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import async_save as _async_save
from torch.distributed.checkpoint.state_dict_saver import save

__all__ = ["FileSystemReader", "FileSystemWriter", "async_save", "load", "save"]


def async_save(state: dict[str, Any], **kwargs: Any) -> Future[Any]:
    """``torch.distributed.checkpoint.async_save`` with the default stager: a future."""
    upload = _async_save(state, **kwargs)
    if not isinstance(upload, Future):  # a staging response only with an async stager
        raise TypeError(f"async_save returned {type(upload).__name__}, not a Future")
    return upload
