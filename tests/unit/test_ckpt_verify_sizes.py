"""Verifying a checkpoint checks sizes (the manifest's, the safetensors header's) before
reading any tensor data: a grown or truncated model.safetensors is refused at once."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest
import torch
from torch import nn

from torchgpu.checkpoint import files, save_checkpoint
from torchgpu.checkpoint.layout import MANIFEST_FILE, MODEL_FILE
from torchgpu.checkpoint.manifest import verify_directory
from torchgpu.cli.main import main
from torchgpu.errors import CheckpointCorruptError

GIB = 1 << 30


class CountingReader:
    """A file handle that counts the bytes read through it, per path."""

    def __init__(self, handle: BinaryIO, path: str, counts: dict[str, int]) -> None:
        self._handle, self._path, self._counts = handle, path, counts

    def read(self, size: int = -1) -> bytes:
        data = self._handle.read(size)
        self._counts[self._path] = self._counts.get(self._path, 0) + len(data)
        if self._counts[self._path] > 1 << 20:  # fail fast instead of reading gigabytes
            raise AssertionError(f"read more than 1 MiB of {self._path}")
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)

    def __enter__(self) -> CountingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.close()


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Bytes read per file name through :func:`torchgpu.checkpoint.files.open_regular`."""
    counts: dict[str, int] = {}
    real = files.open_regular

    def counting(path: str | Path) -> Any:
        return CountingReader(real(path), Path(path).name, counts)

    monkeypatch.setattr(files, "open_regular", counting)
    yield counts


def checkpoint(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    return save_checkpoint(tmp_path / "ck", model=nn.Linear(64, 64), step=1)


def header_bytes(model: Path) -> int:
    with open(model, "rb") as handle:
        return 8 + int(struct.unpack("<Q", handle.read(8))[0])


def record_in_manifest(directory: Path, name: str) -> None:
    """Make the manifest agree with ``name`` as it is now (size and sha256)."""
    manifest = json.loads((directory / MANIFEST_FILE).read_text())
    data = (directory / name).read_bytes()
    manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(),
                               "size_bytes": len(data)}
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest))


def test_grown_sparse_model_file_is_refused_without_reading_its_data(
        tmp_path: Path, reads: dict[str, int]) -> None:
    ck = checkpoint(tmp_path)
    model = ck / MODEL_FILE
    header = header_bytes(model)
    os.truncate(model, 8 * GIB)  # sparse: costs no disk, but 8 GiB to hash
    with pytest.raises(CheckpointCorruptError, match=rf"is {8 * GIB} bytes but the manifest "
                                                     r"records \d+ \(altered\)"):
        verify_directory(ck)
    assert reads.get(MODEL_FILE, 0) <= header


def test_grown_model_file_with_a_matching_manifest_is_refused_by_its_header(
        tmp_path: Path, reads: dict[str, int]) -> None:
    """Even when the manifest lists the grown size, the header tells the real one."""
    ck = checkpoint(tmp_path)
    model = ck / MODEL_FILE
    real_size = model.stat().st_size
    header = header_bytes(model)
    with open(model, "ab") as handle:
        handle.write(b"\0" * 4096)
    record_in_manifest(ck, MODEL_FILE)
    reads.clear()
    with pytest.raises(CheckpointCorruptError, match=rf"is {real_size + 4096} bytes but its "
                                                     rf"safetensors header describes {real_size} "
                                                     r"\(altered: bytes after the last tensor\)"):
        verify_directory(ck)
    assert reads.get(MODEL_FILE, 0) <= header


def test_truncated_model_file_is_refused_reading_only_its_header(
        tmp_path: Path, reads: dict[str, int]) -> None:
    ck = checkpoint(tmp_path)
    model = ck / MODEL_FILE
    size = model.stat().st_size
    os.truncate(model, size - 100)
    with pytest.raises(CheckpointCorruptError, match=rf"is {size - 100} bytes but the manifest "
                                                     rf"records {size} \(truncated\)"):
        verify_directory(ck)
    assert reads.get(MODEL_FILE, 0) == 0  # the size alone told
    record_in_manifest(ck, MODEL_FILE)  # a manifest rewritten for the cut file: the header
    reads.clear()
    with pytest.raises(CheckpointCorruptError, match=r"truncated"):
        verify_directory(ck)
    assert reads.get(MODEL_FILE, 0) <= header_bytes(model)


def test_cli_verify_of_a_sparse_8_gib_model_file_is_exit_1_in_one_paragraph(
        tmp_path: Path, reads: dict[str, int], capsys: pytest.CaptureFixture[str]) -> None:
    ck = checkpoint(tmp_path)
    os.truncate(ck / MODEL_FILE, 8 * GIB)
    assert main(["ckpt", "verify", str(ck)]) == 1
    err = capsys.readouterr().err
    assert str(ck / MODEL_FILE) in err and "altered" in err and "Traceback" not in err
    assert reads.get(MODEL_FILE, 0) <= header_bytes(ck / MODEL_FILE)


def test_intact_checkpoint_still_verifies(tmp_path: Path) -> None:
    ck = checkpoint(tmp_path)
    checked = verify_directory(ck)
    assert checked[MODEL_FILE] == (ck / MODEL_FILE).stat().st_size
