"""Where checkpoint paths lead: a checkpoint directory stripped of its manifest, state
and meta is still a checkpoint (refused unverified, never read as plain weights), and
``ckpt convert`` never writes into what it reads or onto a file of the run's
checkpoints -- whatever links the paths go through."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from torchgpu.checkpoint import (
    convert_checkpoint,
    load_checkpoint,
    load_state_dict,
    verify_checkpoint,
)
from torchgpu.checkpoint.discover import locate
from torchgpu.cli.main import main
from torchgpu.errors import CheckpointCorruptError, CheckpointError
from torchgpu.models.housing import HousingNet


def cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(args)
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def _one_paragraph(err: str) -> None:
    """The error is one paragraph: its last line (train notes the device before it)."""
    lines = err.strip().splitlines()
    assert "Traceback" not in err and lines[-1].startswith("torchgpu: "), err
    assert not [line for line in lines[:-1] if line.startswith("torchgpu: ")], err


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished `torchgpu train --save-every 5` run (kept pristine; tests copy it)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    code = main(["train", "--example", "housing", "--data-size", "60", "--epochs", "2",
                 "--batch-size", "8", "--save-every", "5", "--device", "cpu",
                 "--out", str(out)])
    assert code == 0
    return out


def _copy(run: Path, where: Path) -> tuple[Path, Path]:
    """A copy of ``run`` at ``where`` and the checkpoint its ``latest`` names."""
    shutil.copytree(run, where, symlinks=True)
    ckpts = where / "checkpoints"
    return where, ckpts / (ckpts / "latest").read_text().strip()


def _snapshot(*roots: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for root in roots for p in sorted(root.rglob("*"))
            if p.is_file()}


def _altered(directory: Path) -> None:
    """Strip ``directory`` to its weights, then change them (what the manifest guarded)."""
    for name in ("manifest.json", "state.pt", "meta.json"):
        (directory / name).unlink()
    model = HousingNet()
    load_state_dict(model, directory, verify=False)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(directory / "model.safetensors"))


# -- a checkpoint stripped of manifest, state and meta ---------------------------------


@pytest.mark.parametrize("where", ["latest step dir", "renamed, named by latest",
                                   "older step dir", "copied out as step-N"])
def test_a_stripped_checkpoint_is_still_refused_unverified(
    where: str, finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, latest = _copy(finished, tmp_path / "run")
    ckpts = run / "checkpoints"
    if where == "renamed, named by latest":
        latest = latest.rename(ckpts / "mine")
        (ckpts / "latest").write_text("mine\n")
    elif where == "older step dir":
        latest = sorted(p for p in ckpts.iterdir() if p.name.startswith("step-"))[0]
    elif where == "copied out as step-N":
        latest = Path(shutil.copytree(latest, tmp_path / "elsewhere" / latest.name))
    _altered(latest)
    assert locate(latest).kind == "checkpoint"
    for call in (lambda: load_state_dict(HousingNet(), latest),
                 lambda: load_checkpoint(latest, model=HousingNet())):
        with pytest.raises(CheckpointCorruptError,
                           match=r"manifest.json is missing \(state.pt and meta.json too\)"):
            call()
    with pytest.raises(CheckpointCorruptError, match="manifest"):
        verify_checkpoint(latest)
    for args in (["ckpt", "convert", str(latest), str(tmp_path / "o.safetensors")],
                 ["ckpt", "verify", str(latest)],
                 ["train", "--example", "housing", "--data-size", "60", "--epochs", "3",
                  "--batch-size", "8", "--device", "cpu", "--out", str(tmp_path / "more"),
                  "--resume", str(latest)]):
        code, _, err = cli(args, capsys)
        assert code in (1, 2) and "manifest.json" in err, (args, err)
        _one_paragraph(err)
    assert not (tmp_path / "o.safetensors").exists()
    model = HousingNet()  # the explicit opt-out still reads the weights alone
    assert load_state_dict(model, latest, verify=False).exact


def test_weights_directories_elsewhere_are_not_checkpoints(tmp_path: Path) -> None:
    """No false alarm: a Hugging Face-style directory, also one a user keeps in a
    checkpoints/ folder of their own (no `latest`, no torchgpu checkpoint beside it)."""
    state = HousingNet().state_dict()
    for directory in (tmp_path / "hf", tmp_path / "checkpoints" / "bert",
                      tmp_path / "step-1"):
        directory.mkdir(parents=True)
        save_file(dict(state), str(directory / "model.safetensors"))
        assert locate(directory).kind == "weights", directory
        assert load_state_dict(HousingNet(), directory).exact


def test_a_run_whose_latest_was_stripped_falls_back_with_a_warning(
    finished: Path, tmp_path: Path
) -> None:
    run, latest = _copy(finished, tmp_path / "run")
    (run / "model.safetensors").unlink()  # a run stopped early: loads read its checkpoints
    _altered(latest)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_checkpoint(run, model=HousingNet())
    assert loaded.path != latest and any("incomplete" in str(w.message) for w in caught)


# -- convert never writes into what it reads ------------------------------------------


def _refused(src: Path, dst: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(["ckpt", "convert", str(src), str(dst), "--force"], capsys)
    assert code == 2 and "even with --force" in err, (src, dst, err)
    _one_paragraph(err)
    with pytest.raises(CheckpointError, match="even with --force"):
        convert_checkpoint(src, dst, overwrite=True)


@pytest.mark.parametrize("linked", ["checkpoints/", "the latest checkpoint",
                                    "an older checkpoint", "nothing"])
def test_convert_refuses_the_run_checkpoints_through_any_link(
    linked: str, finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, latest = _copy(finished, tmp_path / "run")
    ckpts = run / "checkpoints"
    older = sorted(p for p in ckpts.iterdir() if p.name.startswith("step-"))[0]
    moved = {"checkpoints/": ckpts, "the latest checkpoint": latest,
             "an older checkpoint": older}.get(linked)
    if moved is not None:  # on "another disk", linked back in place
        disk = tmp_path / "disk" / moved.name
        disk.parent.mkdir()
        moved.rename(disk)
        moved.symlink_to(disk)
    (tmp_path / "to_ckpts").symlink_to(ckpts)
    (tmp_path / "out").mkdir()
    os.link(latest / "model.safetensors", tmp_path / "out" / "hard.safetensors")
    os.link(ckpts / "latest", tmp_path / "out" / "hard_latest.pt")
    (tmp_path / "out" / "soft.safetensors").symlink_to(older / "state.pt")
    before = _snapshot(run, tmp_path / "disk") if moved else _snapshot(run)
    model_file = latest / "model.safetensors"
    for src, dst in (
        (run, latest / "model.safetensors"), (run, ckpts / "latest"),
        (run, Path(os.path.realpath(latest)) / "model.safetensors"),
        (run, Path(os.path.realpath(older)) / "x.safetensors"),
        (ckpts, latest / "meta.json"), (latest, older / "model.safetensors"),
        (model_file, latest / "state.pt"), (model_file, older / "manifest.json"),
        (model_file, ckpts / "latest"), (model_file, ckpts / older.name / "new.safetensors"),
        (model_file, tmp_path / "to_ckpts" / latest.name / "state.pt"),
        (Path(os.path.realpath(model_file)), latest / "state.pt"),
        (run, tmp_path / "out" / "hard.safetensors"),
        (run, tmp_path / "out" / "hard_latest.pt"),
        (model_file, tmp_path / "out" / "hard.safetensors"),
        (latest, tmp_path / "out" / "soft.safetensors"),
        (tmp_path / "to_ckpts", run / "checkpoints" / "x.pt"),
        (run / "model.safetensors", latest / "state.pt"),
        (run / "model.safetensors", older / "model.safetensors"),
    ):
        _refused(src, dst, capsys)
    after = _snapshot(run, tmp_path / "disk") if moved else _snapshot(run)
    assert after == before
    verify_checkpoint(run)
    verify_checkpoint(older)
    # What overwrites nothing of the source and its checkpoints is still written.
    for src, dst in ((run, tmp_path / "out" / "a.safetensors"),
                     (model_file, ckpts / "beside.safetensors"),
                     (model_file, run / "converted.safetensors"),
                     (model_file, tmp_path / "out" / "hard.safetensors.new")):
        code, _, err = cli(["ckpt", "convert", str(src), str(dst), "--force"], capsys)
        assert code == 0 and dst.is_file(), (src, dst, err)


def test_convert_beside_a_plain_file_and_a_nul_byte(tmp_path: Path) -> None:
    source = tmp_path / "a.safetensors"
    save_file(dict(HousingNet().state_dict()), str(source))
    (tmp_path / "b.safetensors").write_bytes(b"old")
    convert_checkpoint(source, tmp_path / "b.safetensors", overwrite=True)  # no checkpoint here
    assert load_state_dict(HousingNet(), tmp_path / "b.safetensors").exact
    for bad in ("a\x00b.safetensors", tmp_path / "a\x00b.safetensors"):
        with pytest.raises(CheckpointError, match=r"a\\x00b.safetensors contains a NUL byte"):
            convert_checkpoint(source, bad)
