"""Reading checkpoint files safely.

Contract:

- The kind of a file is decided by its bytes, never by its name: ``PK`` zip (torch.save),
  a pickle stream (legacy torch.save or plain pickle), or safetensors (8-byte header
  length + JSON header). A ``.safetensors`` name on anything else, an unknown layout, a
  truncated file or a safetensors header claiming more than :data:`MAX_HEADER_BYTES`
  (a "header bomb") raises :class:`CheckpointFormatError` before any data is read.
- Pickles are loaded with ``torch.load(..., weights_only=True)`` passed explicitly, so
  ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` cannot turn it off (torch only lets that
  variable override a call site that left ``weights_only`` unset). Zip pickles are also
  scanned statically first (:func:`unsafe_globals`) and refused when they name globals
  outside torch's weights-only allowlist. There is no silent fallback: ``trust=True`` is
  the only way to run the full unpickler, and it warns.
"""

from __future__ import annotations

import json
import os
import pickletools
import struct
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from torchgpu.checkpoint import files
from torchgpu.errors import CheckpointFormatError

if TYPE_CHECKING:
    from torch.serialization import MAP_LOCATION

FileKind = Literal["torch-zip", "pickle", "safetensors"]

#: Largest safetensors JSON header accepted (the safetensors library's own limit).
MAX_HEADER_BYTES = 100_000_000

_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_PROTO = 0x80

TRUST_HINT = (
    "Only if you trust where the file came from, pass trust=True "
    "(CLI: --trust-checkpoint) to unpickle it fully"
)


def _format_error(path: Path, problem: str, fix: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{files.show(path)}: {problem}. {fix}.")


def sniff(path: Path) -> FileKind:
    """The kind of checkpoint file ``path`` holds, judged by its first bytes.

    Raises :class:`CheckpointFormatError` when the file is missing, empty, not a
    recognised layout, or named ``.safetensors`` while holding something else.
    """
    if files.kind_of(path) == "missing":
        raise _format_error(path, "no such file", "Check the path")
    with files.open_regular(path) as handle:  # refuses FIFOs, devices, directories
        try:
            size = os.fstat(handle.fileno()).st_size
            head = handle.read(9)
        except OSError as error:
            raise files.os_error(path, error) from None
    if len(head) < 2:
        raise _format_error(path, f"file is {size} bytes, too short for any checkpoint", (
            "It was probably truncated; use an earlier checkpoint"))
    kind: FileKind
    if head.startswith(_ZIP_MAGIC):
        kind = "torch-zip"
    elif _looks_safetensors(head):
        kind = "safetensors"
    elif head[0] == _PICKLE_PROTO:
        kind = "pickle"
    else:
        raise _format_error(
            path, "not a torch.save zip, a pickle, or a safetensors file (unknown leading bytes "
            f"{head[:8].hex()})", "Use a .pt/.pth/.bin/.ckpt/.safetensors file or a torchgpu "
            "checkpoint directory")
    if path.suffix == ".safetensors" and kind != "safetensors":
        raise _format_error(
            path, f"named .safetensors but holds a {kind} file (a renamed pickle)",
            "Rename it to .pt if it is a torch.save file and load it with the weights-only "
            "reader; do not trust it blindly")
    return kind


def _looks_safetensors(head: bytes) -> bool:
    """Whether the first 9 bytes of a file are a safetensors start: an 8-byte
    little-endian header length, then the JSON header's ``{``.

    Tested before the pickle byte: a header length ending in byte 0x80 (one file in 256)
    starts with the pickle PROTO opcode too. A safetensors header length starting 0x80
    is still told apart from a pickle by bytes 4-7: they are zero for any header under
    4 GiB (the limit is :data:`MAX_HEADER_BYTES`), and no pickle of protocol 2+ holds
    zeros there followed by ``{`` (``{`` is no pickle opcode; protocol 4+ puts a FRAME
    length there whose byte 8 is zero). A file starting 0x80 that claims a larger
    header is taken for the pickle it then must be.
    """
    if len(head) < 9 or head[8:9] != b"{":
        return False
    return head[0] != _PICKLE_PROTO or head[4:8] == b"\0\0\0\0"


def safetensors_header(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """Parse a safetensors header without reading tensor data.

    Returns ``(tensors, metadata)``: ``tensors`` maps each name to
    ``{"dtype", "shape", "data_offsets"}``. Checks the header length against
    :data:`MAX_HEADER_BYTES` and the file size, and that every tensor's bytes lie
    inside the file; any violation is a :class:`CheckpointFormatError`.
    """
    _, _, tensors, metadata = _parse_header(path)
    return tensors, metadata


def safetensors_extent(path: Path) -> tuple[int, int]:
    """``(expected, actual)`` sizes of safetensors file ``path`` in bytes, reading only
    its header: ``expected`` is the 8-byte length, the header and the tensor data up to
    the end of the last tensor (a valid file has nothing after it); ``actual`` the
    file's size. Raises :class:`CheckpointFormatError` as :func:`safetensors_header`
    does (a file too short for its header or tensors among it)."""
    header_len, size, tensors, _ = _parse_header(path)
    data = max((int(info["data_offsets"][1]) for info in tensors.values()), default=0)
    return 8 + header_len + data, size


def _parse_header(path: Path) -> tuple[int, int, dict[str, Any], dict[str, Any]]:
    """(header length, file size, tensors, metadata) of safetensors file ``path``."""
    with files.open_regular(path) as handle:
        try:
            size = os.fstat(handle.fileno()).st_size
            prefix = handle.read(8)
        except OSError as error:
            raise files.os_error(path, error) from None
        if len(prefix) < 8:
            raise _format_error(path, "safetensors file shorter than its 8-byte header length",
                                "The file is truncated; use an earlier checkpoint")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES:
            raise _format_error(
                path, f"safetensors header claims {header_len} bytes (limit {MAX_HEADER_BYTES}); "
                "this is a malformed or hostile file (header bomb)", "Do not use this file")
        if 8 + header_len > size:
            raise _format_error(
                path, f"safetensors header claims {header_len} bytes but the file has only "
                f"{size} bytes", "The file is truncated; use an earlier checkpoint")
        try:
            raw = handle.read(header_len)
        except OSError as error:
            raise files.os_error(path, error) from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _format_error(path, f"safetensors header is not valid JSON ({error})",
                            "The file is corrupt; use an earlier checkpoint") from None
    if not isinstance(header, dict):
        raise _format_error(path, "safetensors header is not a JSON object",
                            "The file is corrupt; use an earlier checkpoint")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise _format_error(path, "safetensors __metadata__ is not a JSON object",
                            "The file is corrupt; use an earlier checkpoint")
    data_bytes = size - 8 - header_len
    for name, info in header.items():
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        shape = info.get("shape") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(_count(x) for x in offsets) and offsets[0] <= offsets[1]):
            raise _format_error(path, f"tensor {name!r} has no valid data_offsets",
                                "The file is corrupt; use an earlier checkpoint")
        if not (isinstance(shape, list) and all(_count(x) for x in shape)
                and isinstance(info.get("dtype"), str)):
            raise _format_error(path, f"tensor {name!r} has no valid dtype and shape",
                                "The file is corrupt; use an earlier checkpoint")
        if offsets[1] > data_bytes:
            raise _format_error(
                path, f"tensor {name!r} ends at byte {offsets[1]} of the data but the file holds "
                f"only {data_bytes} data bytes (truncated)", "Use an earlier checkpoint")
    return header_len, size, header, {str(k): str(v) for k, v in metadata.items()}


def _count(value: object) -> bool:
    """A JSON value usable as a size or offset: a non-negative int (not a bool, NaN...)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_safetensors(
    path: Path, device: str = "cpu"
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors of a safetensors file (on ``device``) and its text metadata."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    _, metadata = safetensors_header(path)
    try:
        if _utf8(str(path)):
            tensors = load_file(str(path), device=device)
        else:  # the library takes only UTF-8 paths; read the bytes ourselves
            from safetensors.torch import load

            tensors = {k: v.to(device) for k, v in load(files.read_bytes(path)).items()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise _format_error(path, f"cannot read safetensors data ({error})",
                            "The file is corrupt or truncated; use an earlier checkpoint") from None
    return tensors, metadata


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def unsafe_globals(path: Path) -> list[str]:
    """Globals a pickle file would import that torch's weights-only allowlist does not
    cover, found by disassembling the pickle (nothing is executed)."""
    kind = sniff(path)
    if kind == "safetensors":
        return []
    if kind == "torch-zip":
        try:
            found = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
        except (ValueError, RuntimeError, OSError) as error:
            raise _format_error(path, f"unreadable torch.save archive ({error})",
                                "The file is corrupt or truncated") from None
        return sorted(found)
    from torch._weights_only_unpickler import _get_allowed_globals

    allowed = set(_get_allowed_globals())
    return sorted(g for g in _pickle_stream_globals(path) if g not in allowed)


def _pickle_stream_globals(path: Path, max_pickles: int = 5) -> set[str]:
    """Globals named by the (up to ``max_pickles``) consecutive pickles at the start of
    ``path`` -- a legacy torch.save file is several pickles in a row."""
    found: set[str] = set()
    with files.open_regular(path) as handle:
        for _ in range(max_pickles):
            strings: list[str] = []
            try:
                for opcode, arg, _pos in pickletools.genops(handle):
                    if opcode.name in ("GLOBAL", "INST") and isinstance(arg, str):
                        found.add(arg.replace(" ", "."))
                    elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                        found.add(f"{strings[-2]}.{strings[-1]}")
                    elif isinstance(arg, str):
                        strings.append(arg)
            except (ValueError, EOFError, UnicodeDecodeError, struct.error, OSError):
                break
    return found


def read_pickle(
    path: Path, *, map_location: MAP_LOCATION = "cpu", trust: bool = False, mmap: bool = False
) -> Any:
    """Load a torch.save / pickle file with the weights-only unpickler.

    ``trust=True`` runs the full unpickler (it can execute code) and warns. Anything
    the weights-only unpickler refuses, or a file that is not a loadable pickle, raises
    :class:`CheckpointFormatError` naming the offending globals. ``mmap=True`` maps
    tensor data instead of reading it (zip files only; used to inspect big files).
    """
    kind = sniff(path)
    if kind == "safetensors":
        raise _format_error(path, "is a safetensors file, not a pickle",
                            "Read it as safetensors")
    if trust:
        warnings.warn(
            f"{path}: loading with the full unpickler because trust=True; this can run "
            "arbitrary code from the file", UserWarning, stacklevel=2)
        try:
            return torch.load(str(path), map_location=map_location, weights_only=False)
        except Exception as error:
            raise _format_error(path, f"cannot be unpickled ({type(error).__name__}: {error})",
                                "The file is corrupt or not a checkpoint") from None
    bad = unsafe_globals(path)
    if bad:
        raise _format_error(
            path, "refused: the pickle needs globals outside torch's weights-only allowlist ("
            + ", ".join(bad[:8]) + (", ..." if len(bad) > 8 else "") + "), which could run code",
            TRUST_HINT)
    try:
        # weights_only=True is passed explicitly: an explicit value is never overridden by
        # TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD (tests/unit/test_ckpt_safety.py checks this).
        return torch.load(str(path), map_location=map_location, weights_only=True,
                          mmap=mmap and kind == "torch-zip")
    except Exception as error:
        raise _format_error(
            path, f"refused by the weights-only unpickler ({_short_reason(error)})",
            "The file is corrupt, truncated, or not a torch.save file; if it is a plain pickle "
            "of trusted objects, " + TRUST_HINT[0].lower() + TRUST_HINT[1:]) from None


def _short_reason(error: BaseException) -> str:
    """The informative line of a torch.load error (torch prepends a long preamble)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for line in lines:
        if "WeightsUnpickler error" in line or "Unsupported" in line:
            return line
    reason = lines[0] if lines else type(error).__name__
    return reason if len(reason) < 200 else reason[:200] + "..."
