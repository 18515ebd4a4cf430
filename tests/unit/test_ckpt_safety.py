"""Reading untrusted files: pickle payloads never run (also with
TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1), malformed files give CheckpointFormatError."""

from __future__ import annotations

import fractions
import os
import pickle
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from torchgpu.checkpoint import (
    inspect_checkpoint,
    load_checkpoint,
    load_state_dict,
    save_checkpoint,
)
from torchgpu.checkpoint.manifest import manifest_bytes
from torchgpu.checkpoint.readers import read_pickle, unsafe_globals
from torchgpu.errors import CheckpointFormatError


class Payload:
    """Unpickling this runs os.system, which creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _payload_files(tmp_path: Path) -> tuple[Path, list[Path]]:
    marker = tmp_path / "PWNED"
    state = {"weight": torch.zeros(2), "evil": Payload(marker)}
    zipped = tmp_path / "evil.pt"
    torch.save(state, zipped)
    legacy = tmp_path / "evil_legacy.pth"
    torch.save(state, legacy, _use_new_zipfile_serialization=False)
    raw = tmp_path / "evil_raw.bin"
    raw.write_bytes(pickle.dumps(state, protocol=2))
    return marker, [zipped, legacy, raw]


@pytest.mark.parametrize("force_env", [False, True])
def test_payload_pickles_are_refused_and_never_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, force_env: bool
) -> None:
    if force_env:
        monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    marker, files = _payload_files(tmp_path)
    for path in files:
        with pytest.raises(CheckpointFormatError, match="trust"):
            read_pickle(path)
        with pytest.raises(CheckpointFormatError):
            load_state_dict(nn.Linear(2, 1), path)
        info = inspect_checkpoint(path)
        assert "posix.system" in info["unsafe_globals"] or "os.system" in info["unsafe_globals"]
        assert not marker.exists(), path
    assert "posix.system" in " ".join(unsafe_globals(files[0])) or "os.system" in " ".join(
        unsafe_globals(files[0]))


def test_torch_honours_explicit_weights_only_despite_force_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The property readers.py relies on: TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 only
    overrides call sites that leave weights_only unset."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    marker, files = _payload_files(tmp_path)
    for path in files:
        with pytest.raises(pickle.UnpicklingError):
            torch.load(path, weights_only=True)
    assert not marker.exists()


def test_payload_in_state_pt_of_a_checkpoint_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Even with a manifest that matches (an attacker can rewrite it), state.pt is
    read weights-only."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    model = nn.Linear(2, 1)
    ckpt = save_checkpoint(tmp_path / "c", model=model)
    marker = tmp_path / "PWNED"
    torch.save({"format": "torchgpu-checkpoint", "x": Payload(marker)}, ckpt / "state.pt")
    names = ["model.safetensors", "state.pt", "meta.json"]
    (ckpt / "manifest.json").write_bytes(manifest_bytes({n: (ckpt / n).read_bytes()
                                                         for n in names}))
    with pytest.raises(CheckpointFormatError, match=r"state\.pt"):
        load_checkpoint(ckpt, model=model)
    assert not marker.exists()


def test_trust_is_the_only_way_and_it_warns(tmp_path: Path) -> None:
    path = tmp_path / "custom.pt"
    torch.save({"weight": torch.ones(2), "ratio": fractions.Fraction(1, 3)}, path)
    assert unsafe_globals(path) == ["fractions.Fraction"]
    with pytest.raises(CheckpointFormatError, match=r"fractions\.Fraction"):
        read_pickle(path)
    with pytest.warns(UserWarning, match="arbitrary code"):
        loaded = read_pickle(path, trust=True)
    assert loaded["ratio"] == fractions.Fraction(1, 3)


def _good_safetensors(path: Path) -> bytes:
    save_file({"w": torch.arange(64, dtype=torch.float32), "b": torch.ones(4)}, str(path))
    return path.read_bytes()


def test_truncated_safetensors(tmp_path: Path) -> None:
    data = _good_safetensors(tmp_path / "ok.safetensors")
    for cut in (len(data) - 10, 20, 5):
        bad = tmp_path / f"cut{cut}.safetensors"
        bad.write_bytes(data[:cut])
        with pytest.raises(CheckpointFormatError, match=r"truncated|shorter|too short"):
            load_state_dict(nn.Linear(2, 2), bad)


def test_renamed_pickle(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    torch.save(nn.Linear(2, 2).state_dict(), path)
    with pytest.raises(CheckpointFormatError, match="renamed pickle"):
        load_state_dict(nn.Linear(2, 2), path)
    with pytest.raises(CheckpointFormatError):
        inspect_checkpoint(path)
    plain = tmp_path / "data.pt"  # a plain pickle named .pt holding a non-torch object
    plain.write_bytes(pickle.dumps({"a": fractions.Fraction(1, 2)}))
    with pytest.raises(CheckpointFormatError):
        load_state_dict(nn.Linear(2, 2), plain)


def test_header_bomb(tmp_path: Path) -> None:
    path = tmp_path / "bomb.safetensors"
    path.write_bytes(struct.pack("<Q", 40 * 1024**3) + b'{"w": {}}')
    with pytest.raises(CheckpointFormatError, match="header bomb"):
        load_state_dict(nn.Linear(2, 2), path)
    with pytest.raises(CheckpointFormatError, match="header bomb"):
        inspect_checkpoint(path)
    lying = tmp_path / "lying.safetensors"  # below the limit, beyond the file
    lying.write_bytes(struct.pack("<Q", 50_000_000) + b'{"w": {}}')
    with pytest.raises(CheckpointFormatError, match="only"):
        inspect_checkpoint(lying)


def test_garbage_empty_and_missing_files(tmp_path: Path) -> None:
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"hello world, not a checkpoint")
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    for path in (junk, empty, tmp_path / "missing.pt"):
        with pytest.raises(CheckpointFormatError, match=str(path.name)):
            load_state_dict(nn.Linear(2, 2), path)


def test_weights_only_load_still_refuses_when_the_static_scan_misses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defence in depth: with the pre-scan disabled and the force variable set, the
    explicit weights_only=True still stops the payload."""
    import torchgpu.checkpoint.readers as readers

    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    monkeypatch.setattr(readers, "unsafe_globals", lambda path: [])
    marker, files = _payload_files(tmp_path)
    for path in files:
        with pytest.raises(CheckpointFormatError, match="weights-only unpickler"):
            readers.read_pickle(path)
    assert not marker.exists()
