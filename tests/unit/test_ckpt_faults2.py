"""Faults on real files, through the Python API and the CLI: saves that must not replace
what is not a checkpoint, names `latest` must be able to hold, a full disk or a refused
directory at every step of a save, a directory where a file should be, JSON with
duplicate keys and numbers no float holds, malformed safetensors headers, paths that are
not UTF-8, verify of run directories, and a resume past a damaged `latest`."""

from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from torchgpu.checkpoint import (
    atomic,
    find_checkpoint,
    inspect_checkpoint,
    load_checkpoint,
    load_state_dict,
    save_checkpoint,
    verify_checkpoint,
)
from torchgpu.checkpoint.layout import MANIFEST_FILE
from torchgpu.checkpoint.manifest import manifest_bytes
from torchgpu.cli.main import main
from torchgpu.errors import CheckpointCorruptError, CheckpointError, CheckpointFormatError

FILES = ("model.safetensors", "state.pt", "meta.json", "manifest.json")


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def _two(parent: Path) -> Path:
    """``parent`` holding step-1 and step-2 (``latest``) of the same net, different steps."""
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in (1, 2):
        save_checkpoint(parent / f"step-{step}", model=model, optimizer=optimizer, step=step)
    return parent


def cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Exit code and stderr; an error is one ``torchgpu:`` paragraph, never a traceback."""
    try:
        code = main(args)
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("torchgpu:")]
    assert "Traceback" not in err and len(errors) == (code != 0), err
    if args[0] == "ckpt":  # nothing else on stderr but notes
        assert all(line.startswith(("torchgpu:", "note:")) for line in err.splitlines()), err
    return code, err


def _rehash(directory: Path) -> None:
    names = [n for n in FILES if n != MANIFEST_FILE]
    (directory / MANIFEST_FILE).write_bytes(
        manifest_bytes({n: (directory / n).read_bytes() for n in names}))


# -- saving never replaces what is not a checkpoint --------------------------------------


@pytest.mark.parametrize("what", ["user directory", "file", "checkpoints directory"])
def test_save_refuses_to_replace_what_is_not_a_checkpoint(tmp_path: Path, what: str) -> None:
    parent = _two(tmp_path / "ckpts")
    if what == "user directory":
        target = tmp_path / "mine"
        target.mkdir()
        (target / "precious.txt").write_text("keep")
    elif what == "file":
        target = tmp_path / "notes.txt"
        target.write_text("keep")
    else:
        target = parent / "."  # pathlib makes this `parent` itself
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(CheckpointError, match=r"would replace it\. Nothing was written"):
        save_checkpoint(target, model=_net(), step=3)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    assert load_checkpoint(parent, model=_net()).step == 2


def test_save_over_an_empty_directory_or_a_checkpoint_is_allowed(tmp_path: Path) -> None:
    (tmp_path / "step-1").mkdir()
    save_checkpoint(tmp_path / "step-1", model=_net(), step=1)
    save_checkpoint(tmp_path / "step-1", model=_net(), step=5)
    assert load_checkpoint(tmp_path, model=_net()).step == 5


@pytest.mark.parametrize("name", ["", "latest", " padded", "tab\tname", "x" * 240,
                                  os.fsdecode(b"ck-\xff")],
                         ids=["empty", "latest", "space", "control", "long", "not-utf8"])
def test_names_latest_could_not_hold_are_refused_before_writing(
    tmp_path: Path, name: str
) -> None:
    with pytest.raises(CheckpointError, match="cannot save a checkpoint as"):
        save_checkpoint(tmp_path / name if name else Path(name), model=_net(), step=1)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["步骤-1", "emoji-🙂", "zero\u200bwidth", "ckpt é"])
def test_unicode_names_round_trip_through_latest_api_and_cli(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    save_checkpoint(tmp_path / name, model=_net(3), step=4)
    assert find_checkpoint(tmp_path) == tmp_path / name
    assert load_checkpoint(tmp_path, model=_net()).step == 4
    assert cli(["ckpt", "verify", str(tmp_path)], capsys)[0] == 0
    assert cli(["ckpt", "inspect", str(tmp_path)], capsys)[0] == 0


def test_a_parent_path_that_is_not_utf8_saves_and_loads(tmp_path: Path) -> None:
    parent = Path(os.fsdecode(bytes(tmp_path) + b"/run-\xff"))
    save_checkpoint(parent / "step-1", model=_net(5), step=1)
    target = _net()
    load_checkpoint(parent, model=target)
    assert torch.equal(target[0].weight, _net(5)[0].weight)
    assert load_state_dict(_net(), parent / "step-1" / "model.safetensors").exact


def test_a_file_in_the_way_of_the_parent_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "run").write_text("not a directory")
    with pytest.raises(CheckpointError, match="is a file, not a directory"):
        save_checkpoint(tmp_path / "run" / "ckpts" / "step-1", model=_net(), step=1)


# -- a refused directory, a full disk: the previous checkpoint stays, latest stays --------


@pytest.mark.parametrize("missing_parent", [False, True])
def test_read_only_directory_fails_cleanly_and_keeps_the_old_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, missing_parent: bool
) -> None:
    parent = _two(tmp_path / "ckpts")
    real_mkdir = os.mkdir

    def refuse(path: Any, *args: Any, **kwargs: Any) -> None:  # as for a non-root user
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(os, "mkdir", refuse)
    target = (parent / "sub" / "step-3") if missing_parent else (parent / "step-2")
    with pytest.raises(CheckpointError, match=r"could not write .*permission denied"):
        save_checkpoint(target, model=_net(7), step=3)
    monkeypatch.setattr(os, "mkdir", real_mkdir)
    assert (parent / "latest").read_text().strip() == "step-2"
    assert sorted(p.name for p in parent.iterdir()) == ["latest", "step-1", "step-2"]
    assert load_checkpoint(parent, model=_net()).step == 2
    assert verify_checkpoint(parent)


@pytest.mark.parametrize("writes_before_full", range(6))
def test_disk_full_at_any_write_keeps_latest_and_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writes_before_full: int
) -> None:
    """Writes 0-3 are the checkpoint's files, 4 is `latest`: whichever fails, `latest`
    does not move, no new directory or temporary stays, and the old one loads."""
    parent = _two(tmp_path)
    real = atomic._write
    count = [0]

    def write(fd: int, view: memoryview) -> int:
        count[0] += 1
        if count[0] > writes_before_full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, view)

    monkeypatch.setattr(atomic, "_write", write)
    try:
        save_checkpoint(parent / "step-3", model=_net(9), step=3)
    except CheckpointError as error:
        assert "the disk is full" in str(error) and "\n" not in str(error)
        assert (parent / "latest").read_text().strip() == "step-2"
        assert sorted(p.name for p in parent.iterdir()) == ["latest", "step-1", "step-2"]
        assert load_checkpoint(parent, model=_net()).step == 2
    else:
        assert writes_before_full >= 5
        assert load_checkpoint(parent, model=_net()).step == 3


# -- damaged checkpoints: API and CLI ----------------------------------------------------


@pytest.mark.parametrize("name", FILES)
def test_directory_in_place_of_a_file_is_damage_verify_exits_1(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parent = _two(tmp_path)
    bad = parent / "step-2"
    (bad / name).unlink()
    (bad / name).mkdir()
    with pytest.raises(CheckpointCorruptError, match=f"{name}.*directory"):
        verify_checkpoint(bad)
    code, err = cli(["ckpt", "verify", str(parent)], capsys)
    assert code == 1 and str(bad) in err and "step-1" in err
    with pytest.raises(CheckpointCorruptError):
        load_checkpoint(bad, model=_net())
    assert cli(["ckpt", "inspect", str(bad)], capsys)[0] == 0  # shows what is wrong
    with pytest.warns(UserWarning, match="step-1"):  # through `latest`: the newest complete
        assert find_checkpoint(parent) == parent / "step-1"


@pytest.mark.parametrize("name", FILES)
def test_a_bit_flip_in_any_file_fails_verify_with_exit_1_and_is_never_loaded(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parent = _two(tmp_path)
    bad = parent / "step-2" / name
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x04
    bad.write_bytes(bytes(data))
    code, err = cli(["ckpt", "verify", str(parent)], capsys)
    assert code == 1 and "step-1" in err
    with pytest.raises(CheckpointCorruptError):
        load_checkpoint(parent / "step-2", model=_net())
    with pytest.raises(CheckpointCorruptError):
        verify_checkpoint(parent)  # the one `latest` names, never a fallback


def test_verify_checkpoint_accepts_run_and_checkpoints_directories(tmp_path: Path) -> None:
    _two(tmp_path / "run" / "checkpoints")
    for path in (tmp_path / "run", tmp_path / "run" / "checkpoints"):
        assert set(verify_checkpoint(path)) == {"model.safetensors", "state.pt", "meta.json"}
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step-9\n")
    with pytest.raises(CheckpointCorruptError, match=r"step-9.*newest checkpoint that verifies"):
        verify_checkpoint(tmp_path / "run")
    with pytest.raises(CheckpointFormatError, match="holds no torchgpu checkpoint"):
        verify_checkpoint(tmp_path / "run" / "checkpoints" / "step-1" / "model.safetensors")


def test_manifest_with_a_duplicate_key_is_malformed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With a key twice, readers disagree on which entry counts; the last one here is the
    real table, so a reader taking the last would verify and one taking the first not."""
    parent = _two(tmp_path)
    manifest = parent / "step-2" / MANIFEST_FILE
    real = json.loads(manifest.read_text())
    decoy = {"state.pt": {"sha256": "0" * 64, "size_bytes": 1}}
    manifest.write_text('{"format": "torchgpu-checkpoint", "files": ' + json.dumps(decoy)
                        + ', "files": ' + json.dumps(real["files"]) + "}")
    with pytest.raises(CheckpointCorruptError, match="appears twice"):
        verify_checkpoint(parent / "step-2")
    assert cli(["ckpt", "verify", str(parent / "step-2")], capsys)[0] == 1


@pytest.mark.parametrize("value", ["1" + "0" * 400, "NaN", "-Infinity", '"soon"'])
@pytest.mark.parametrize("field", ["created_unix_s", "step"])
def test_meta_numbers_no_float_holds_never_break_finding_or_pruning(
    tmp_path: Path, field: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parent = _two(tmp_path)
    odd = parent / "step-1"
    meta = json.loads((odd / "meta.json").read_text())
    text = json.dumps({**meta, field: "PLACEHOLDER"}).replace('"PLACEHOLDER"', value)
    (odd / "meta.json").write_text(text)
    _rehash(odd)
    (parent / "latest").unlink()
    assert find_checkpoint(parent) == parent / "step-2"
    assert load_checkpoint(parent, model=_net()).step == 2
    assert inspect_checkpoint(odd)["path"] == str(odd)
    for args in (["inspect", str(parent)], ["inspect", "--json", str(odd)],
                 ["verify", str(parent)]):
        assert cli(["ckpt", *args], capsys)[0] == 0
    save_checkpoint(parent / "step-3", model=_net(), step=3, keep_last=1)
    assert (parent / "latest").read_text().strip() == "step-3"


def _safetensors(header: dict[str, Any], data: bytes = b"\0" * 16) -> bytes:
    raw = json.dumps(header, allow_nan=True).encode()
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.mark.parametrize("header", [
    {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, float("nan")]}},
    {"w": {"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]}},
    {"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}},
    {"w": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}},
    {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "__metadata__": [1]},
], ids=["nan-offset", "string-offsets", "reversed", "shape-not-list", "metadata-list"])
def test_malformed_safetensors_headers_are_format_errors_everywhere(
    tmp_path: Path, header: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "w.safetensors"
    path.write_bytes(_safetensors(header))
    with pytest.raises(CheckpointFormatError, match=r"w\.safetensors"):
        inspect_checkpoint(path)
    with pytest.raises(CheckpointFormatError):
        load_state_dict(nn.Linear(2, 1, bias=False), path)
    for args in (["inspect", str(path)], ["convert", str(path), str(tmp_path / "o.pt")]):
        code, err = cli(["ckpt", *args], capsys)
        assert code == 2 and str(path) in err


def test_aliases_metadata_that_is_not_an_object_is_a_format_error(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file({"w": torch.zeros(2)}, str(path), metadata={"torchgpu.aliases": "[1, 2]"})
    with pytest.raises(CheckpointFormatError, match="aliases"):
        load_state_dict(nn.Linear(2, 1, bias=False), path)


# -- train --resume ---------------------------------------------------------------------


def test_resume_through_latest_past_a_directory_in_place_of_state_pt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    base = ["train", "--example", "housing", "--data-size", "100", "--batch-size", "16",
            "--device", "cpu", "--progress", "off", "--out", str(out)]
    code, _ = cli([*base, "--epochs", "1", "--save-every", "2"], capsys)
    assert code == 0
    checkpoints = out / "checkpoints"
    latest = checkpoints / (checkpoints / "latest").read_text().strip()
    (latest / "state.pt").unlink()
    (latest / "state.pt").mkdir()
    code, err = cli([*base, "--epochs", "2", "--resume"], capsys)
    assert code == 0 and latest.name == "step-00000004"
    assert "names 'step-00000004'" in err and "resuming from" in err and "step-00000002" in err
    moved = out / "checkpoints-abandoned-after-step-00000002" / latest.name
    assert (moved / "state.pt").is_dir()  # set aside as it was, not deleted
    code, err = cli([*base, "--epochs", "2", "--resume", str(moved)], capsys)
    assert code == 2 and "state.pt is a directory" in err


def test_train_exits_1_when_the_disk_is_full_at_a_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A full disk is a runtime failure (exit 1), not bad input (exit 2); no checkpoint
    is left half-written."""
    from torchgpu.cli.main import main
    from torchgpu.errors import CheckpointWriteError

    def full(fd: int, view: memoryview) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic, "_write", full)
    out = tmp_path / "run"
    code = main(["train", "--example", "housing", "--data-size", "64", "--epochs", "1",
                 "--batch-size", "16", "--device", "cpu", "--save-every", "2",
                 "--out", str(out), "--progress", "off"])
    err = capsys.readouterr().err
    assert code == CheckpointWriteError.exit_code == 1, err
    assert "the disk is full" in err and "Traceback" not in err
    ckpts = out / "checkpoints"
    assert not ckpts.exists() or not any(ckpts.iterdir())
