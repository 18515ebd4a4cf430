"""Checkpoint integrity: old state-dict versions, finished run directories, manifests that
must cover what is loaded, destinations inside the source, paths the operating system
refuses (link loops, long names, no permission, FIFOs, devices), the final model's mode."""

from __future__ import annotations

import errno
import json
import os
import stat
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from torchgpu.checkpoint import (
    convert_checkpoint,
    find_checkpoint,
    inspect_checkpoint,
    load_checkpoint,
    load_state_dict,
    save_checkpoint,
    verify_checkpoint,
)
from torchgpu.cli.main import main
from torchgpu.errors import CheckpointCorruptError, CheckpointError, CheckpointFormatError
from torchgpu.models.housing import HousingNet
from torchgpu.train.outputs import files as outputs

ROOT = os.geteuid() == 0 if hasattr(os, "geteuid") else False


def cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(args)
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def _one_paragraph(err: str) -> None:
    assert "Traceback" not in err and err.strip().count("\n") == 0, err


def _bn_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))


def _as_version_1(state: dict[str, Any]) -> OrderedDict[str, Any]:
    """``state`` as torch < 0.4.1 saved it: no num_batches_tracked, BatchNorm version 1."""
    old: OrderedDict[str, Any] = OrderedDict(
        (k, v.clone()) for k, v in state.items() if not k.endswith("num_batches_tracked"))
    old._metadata = OrderedDict(  # type: ignore[attr-defined]
        (path, {"version": 1}) for path in state._metadata)  # type: ignore[attr-defined]
    return old


# -- old BatchNorm state dicts (metadata version 1) ------------------------------------


@pytest.mark.parametrize("wrapped", [False, True])
def test_version_1_batchnorm_state_loads_strictly_like_module_load_state_dict(
    wrapped: bool, tmp_path: Path
) -> None:
    source = _bn_net(1)
    source[1].running_mean.fill_(0.5)
    saved = (nn.DataParallel(source) if wrapped else source).state_dict()
    old = _as_version_1(saved)
    assert ("module.1" in old._metadata) is wrapped  # type: ignore[attr-defined]
    reference = _bn_net(2)
    reference.load_state_dict(_as_version_1(source.state_dict()))  # torch itself accepts it
    for given in (old, tmp_path / "old.pt"):
        torch.save(old, tmp_path / "old.pt")
        target = _bn_net(3)
        report = load_state_dict(target, given)
        assert report.exact and report.strip == ("module." if wrapped else "")
        assert torch.equal(target[1].running_mean, torch.full((4,), 0.5))
        assert torch.equal(target[0].weight, source[0].weight)
    into_dp = nn.DataParallel(_bn_net(4))  # and into a wrapper: metadata gains the prefix
    load_state_dict(into_dp, old)
    assert torch.equal(into_dp.module[1].running_mean, torch.full((4,), 0.5))


class Versioned(nn.Module):
    """A module whose version-2 layout added buffer ``count``; its loader supplies it only
    when the metadata says the state is older (version 1), unlike BatchNorm, which also
    fills it when no version is recorded. So it proves the metadata reaches torch."""

    _version = 2

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(3))
        self.register_buffer("count", torch.tensor(0))

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str,
                              local_metadata: dict[str, Any], *args: Any) -> None:
        version = local_metadata.get("version")
        if version is not None and version < 2:
            state_dict.setdefault(prefix + "count", torch.tensor(7))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


def test_metadata_is_mapped_with_the_keys_and_reaches_versioned_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    holder = nn.Sequential(Versioned())
    old: OrderedDict[str, Any] = OrderedDict({"module.0.weight": torch.ones(3)})
    old._metadata = OrderedDict(  # type: ignore[attr-defined]
        {"": {"version": 1}, "module": {"version": 1}, "module.0": {"version": 1}})
    assert load_state_dict(holder, old).exact
    assert int(holder[0].count) == 7 and torch.equal(holder[0].weight, torch.ones(3))
    # Without the metadata the state is current-version and count is really missing.
    plain = OrderedDict(old)
    with pytest.raises(CheckpointError, match="count"):
        load_state_dict(nn.Sequential(Versioned()), plain)
    # `ckpt convert --format pt` keeps the metadata, re-keyed with the keys.
    torch.save(old, tmp_path / "dp.pt")
    code, _, err = cli(["ckpt", "convert", str(tmp_path / "dp.pt"), str(tmp_path / "p.pt")],
                       capsys)
    assert code == 0, err
    converted = torch.load(tmp_path / "p.pt", weights_only=True)
    assert converted._metadata["0"] == {"version": 1}
    fresh = nn.Sequential(Versioned())
    load_state_dict(fresh, tmp_path / "p.pt")
    assert int(fresh[0].count) == 7


# -- a finished run directory is accepted wherever a path is -----------------------------


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished `torchgpu train` run: OUT/checkpoints/step-* and OUT/model.safetensors."""
    out = tmp_path_factory.mktemp("finished") / "run"
    code = main(["train", "--example", "housing", "--data-size", "60", "--epochs", "2",
                 "--batch-size", "8", "--save-every", "5", "--device", "cpu",
                 "--out", str(out)])
    assert code == 0
    assert (out / "model.safetensors").is_file() and (out / "checkpoints" / "latest").is_file()
    return out


def test_finished_run_directory_verifies_loads_and_resumes(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpts = run_dir / "checkpoints"
    latest = ckpts / (ckpts / "latest").read_text().strip()
    for path in (run_dir, ckpts, latest):
        code, out, err = cli(["ckpt", "verify", str(path)], capsys)
        assert code == 0 and out.startswith(f"ok: {latest} "), (path, out, err)
        loaded = load_checkpoint(path, model=HousingNet())
        assert loaded.path == latest and loaded.step == 10  # saved every 5 of 12 steps
        code, out, err = cli(["ckpt", "inspect", str(path), "--json"], capsys)
        assert code == 0 and json.loads(out)["num_tensors"] == 6, err
        dst = tmp_path / f"{path.name}.safetensors"
        code, out, err = cli(["ckpt", "convert", str(path), str(dst)], capsys)
        assert code == 0 and dst.is_file(), err
    assert find_checkpoint(run_dir) == latest
    # Weights of a finished run: its final model, the trained result.
    model = HousingNet()
    assert load_state_dict(model, run_dir).exact
    final = load_file(run_dir / "model.safetensors")
    assert all(torch.equal(final[k], v) for k, v in model.state_dict().items())
    # --resume RUN_DIR continues from the run's latest checkpoint.
    code, _, err = cli(["train", "--example", "housing", "--data-size", "60", "--epochs", "3",
                        "--batch-size", "8", "--device", "cpu", "--out", str(tmp_path / "more"),
                        "--resume", str(run_dir)], capsys)
    assert code == 0 and f"resuming from {latest}" in err, err


def test_final_model_has_the_mode_of_the_other_files(
    run_dir: Path, tmp_path: Path
) -> None:
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in run_dir.iterdir() if p.is_file()}
    assert len(set(modes.values())) == 1, modes
    old = os.umask(0o027)
    try:
        outputs.save_model(tmp_path / "model.safetensors", {"w": torch.ones(2)})
        (tmp_path / "plain.txt").write_text("x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "model.safetensors").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode) == 0o640
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


# -- manifests ---------------------------------------------------------------------------


def _ckpt(tmp_path: Path) -> Path:
    return save_checkpoint(tmp_path / "ck" / "step-1", model=_bn_net(), step=1)


def _alter_weights(directory: Path) -> None:
    path = directory / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


MALFORMED = {
    "empty files": lambda m: {**m, "files": {}},
    "model unlisted": lambda m: {**m, "files": {k: v for k, v in m["files"].items()
                                                if k != "model.safetensors"}},
    "files a list": lambda m: {**m, "files": list(m["files"])},
    "files missing": lambda m: {"format": m["format"]},
    "entry a string": lambda m: {**m, "files": {**m["files"], "model.safetensors": "abc"}},
    "size a string": lambda m: {**m, "files": {**m["files"], "model.safetensors": {
        **m["files"]["model.safetensors"], "size_bytes": "12"}}},
    "sha missing": lambda m: {**m, "files": {**m["files"], "model.safetensors": {
        "size_bytes": m["files"]["model.safetensors"]["size_bytes"]}}},
    "escaping name": lambda m: {**m, "files": {**m["files"], "../../x": {
        "sha256": "0" * 64, "size_bytes": 1}}},
    "not an object": lambda m: [m],
    "null": lambda m: None,
}


@pytest.mark.parametrize("case", [*MALFORMED, "not json", "binary"])
def test_malformed_manifest_is_corrupt_naming_it_never_loaded(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = _ckpt(tmp_path)
    manifest = directory / "manifest.json"
    _alter_weights(directory)
    if case == "not json":
        manifest.write_text("{not json")
    elif case == "binary":
        manifest.write_bytes(b"\xff\xfe\x00")
    else:
        manifest.write_text(json.dumps(MALFORMED[case](json.loads(manifest.read_text()))))
    for call in (lambda: verify_checkpoint(directory),
                 lambda: load_checkpoint(directory, model=_bn_net()),
                 lambda: load_state_dict(_bn_net(), directory)):
        with pytest.raises(CheckpointCorruptError, match=r"manifest\.json"):
            call()
    code, _, err = cli(["ckpt", "verify", str(directory)], capsys)
    assert code == 1 and str(manifest) in err and "Traceback" not in err


def test_deleted_manifest_is_refused_with_the_opt_out(tmp_path: Path) -> None:
    directory = _ckpt(tmp_path)
    (directory / "manifest.json").unlink()
    for call in (lambda: load_state_dict(_bn_net(), directory),
                 lambda: load_checkpoint(directory, model=_bn_net())):
        with pytest.raises(CheckpointCorruptError, match=r"manifest.json is missing.*verify=False"):
            call()
    model = _bn_net(5)
    assert load_state_dict(model, directory, verify=False).exact  # the explicit opt-out
    assert load_checkpoint(directory, model=_bn_net(6), verify=False).step == 1


# -- convert never writes into its source ------------------------------------------------


def test_convert_refuses_a_destination_inside_or_around_the_source(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = _ckpt(tmp_path)
    ck = directory.parent
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    (tmp_path / "link").symlink_to(directory)
    for src, dst in ((directory, directory / "model.safetensors"),
                     (ck, directory / "model.safetensors"),
                     (ck, ck / "out.safetensors"),
                     (directory, tmp_path / "link" / "new.safetensors"),
                     (tmp_path / "link", directory / "x.pt"),
                     (directory / "model.safetensors", directory / "model.safetensors")):
        code, _, err = cli(["ckpt", "convert", str(src), str(dst), "--force"], capsys)
        assert code == 2 and "source" in err, (src, dst, err)
        _one_paragraph(err)
    code, _, err = cli(["ckpt", "convert", str(directory / "model.safetensors"),
                        str(tmp_path), "--force"], capsys)  # contains the source; a directory
    assert code == 2
    _one_paragraph(err)
    with pytest.raises(CheckpointError, match="inside the source"):
        convert_checkpoint(directory, directory / "model.safetensors", overwrite=True)
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
    verify_checkpoint(directory)


# -- paths the operating system refuses --------------------------------------------------


def _bad_path(what: str, tmp_path: Path) -> Path:
    if what == "link loop":
        (tmp_path / "loop").symlink_to(tmp_path / "loop")
        return tmp_path / "loop"
    if what == "fifo":
        os.mkfifo(tmp_path / "fifo")
        return tmp_path / "fifo"
    if what == "long name":
        return tmp_path / ("x" * 5000)
    path = Path({"device": "/dev/zero", "proc mem": "/proc/self/mem"}[what])
    if not path.exists():
        pytest.skip(f"{path} does not exist here")
    return path


@pytest.mark.parametrize("what", ["link loop", "fifo", "device", "proc mem", "long name"])
def test_bad_paths_are_one_paragraph_errors_everywhere(
    what: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _bad_path(what, tmp_path)
    shown = str(path)[:100]
    why = {"link loop": "link loop", "fifo": "FIFO", "device": "character device",
           "proc mem": "could not be read", "long name": "too long"}[what]
    for call in (lambda: load_state_dict(_bn_net(), path),
                 lambda: load_checkpoint(path, model=_bn_net()),
                 lambda: inspect_checkpoint(path)):
        with pytest.raises(CheckpointError) as raised:
            call()
        assert shown in str(raised.value) and why in str(raised.value), raised.value
    for args in (["ckpt", "inspect", str(path)], ["ckpt", "verify", str(path)],
                 ["ckpt", "convert", str(path), str(tmp_path / "o.safetensors")],
                 ["train", "--example", "housing", "--data-size", "60",
                  "--out", str(tmp_path / "r"), "--resume", str(path)]):
        code, _, err = cli(args, capsys)
        assert code == 2 and shown in err, (args, err)
        # /proc/self/mem claims to be a regular file: verify and --resume look for a
        # checkpoint directory and say there is none, without reading it.
        assert why in err or (what == "proc mem" and args[1] in ("verify", "--example")), err
        _one_paragraph(err)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("content", ["x" * 5000, "step-1\x00", "a\nb", "../escape", "..",
                                     "step-1/../../x"])
def test_bad_latest_is_a_one_paragraph_error(
    content: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = _ckpt(tmp_path)
    ck = directory.parent
    (ck / "latest").write_text(content + "\n")
    for call in (lambda: find_checkpoint(ck), lambda: load_checkpoint(ck, model=_bn_net()),
                 lambda: load_state_dict(_bn_net(), ck)):
        with pytest.raises(CheckpointFormatError, match="latest"):
            call()
    for args in (["ckpt", "verify", str(ck)], ["ckpt", "inspect", str(ck)]):
        code, _, err = cli(args, capsys)
        assert code == 2 and str(ck / "latest") in err, err
        _one_paragraph(err)
        assert len(err) < 1000  # the 5000-character name is shortened


def test_latest_that_is_a_fifo_or_a_loop_is_refused_without_blocking(tmp_path: Path) -> None:
    ck = _ckpt(tmp_path).parent
    (ck / "latest").unlink()
    os.mkfifo(ck / "latest")  # reading it would block forever
    with pytest.raises(CheckpointFormatError, match="FIFO"):
        find_checkpoint(ck)
    (ck / "latest").unlink()
    (ck / "latest").symlink_to(ck / "latest")
    with pytest.raises(CheckpointFormatError, match="link loop"):
        find_checkpoint(ck)


def test_checkpoint_file_that_is_a_fifo_or_device_is_never_read(tmp_path: Path) -> None:
    directory = _ckpt(tmp_path)
    (directory / "state.pt").unlink()
    os.mkfifo(directory / "state.pt")
    with pytest.raises(CheckpointFormatError, match="FIFO"):
        verify_checkpoint(directory)
    (directory / "model.safetensors").unlink()
    (directory / "model.safetensors").symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match="character device"):
        load_state_dict(_bn_net(), directory, verify=False)


def _deny(monkeypatch: pytest.MonkeyPatch, denied: Path) -> None:
    """Make opening or listing ``denied`` fail as it would for a non-root user after
    chmod 000 (tests run as root, where permission bits do not stop reads)."""
    real_open, real_iterdir = os.open, Path.iterdir

    def fake_open(path: Any, *args: Any, **kwargs: Any) -> int:
        if Path(path) == denied or denied in Path(path).parents:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    def fake_iterdir(self: Path) -> Any:
        if self == denied:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_iterdir(self)

    monkeypatch.setattr(os, "open", fake_open)  # every checkpoint read opens through it
    monkeypatch.setattr(Path, "iterdir", fake_iterdir)


@pytest.mark.parametrize("name", ["model.safetensors", "state.pt", "manifest.json", "latest"])
def test_unreadable_file_is_a_permission_error_naming_it(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str]
) -> None:
    directory = _ckpt(tmp_path)
    denied = (directory.parent if name == "latest" else directory) / name
    _deny(monkeypatch, denied)
    where = directory.parent
    for call in (lambda: load_checkpoint(where, model=_bn_net()),
                 lambda: load_state_dict(_bn_net(), where)):
        with pytest.raises(CheckpointFormatError, match="permission denied") as raised:
            call()
        assert str(denied) in str(raised.value)
    code, _, err = cli(["ckpt", "verify", str(where)], capsys)
    assert code == 2 and str(denied) in err and "permission denied" in err, err
    _one_paragraph(err)


def test_unreadable_directory_is_a_permission_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ck = _ckpt(tmp_path).parent
    (ck / "latest").unlink()  # so the directory must be listed
    _deny(monkeypatch, ck)
    with pytest.raises(CheckpointFormatError, match="permission denied"):
        find_checkpoint(ck)
    code, _, err = cli(["ckpt", "verify", str(ck)], capsys)
    assert code == 2 and str(ck) in err, err
    _one_paragraph(err)


@pytest.mark.skipif(ROOT, reason="root reads files whatever their mode (simulated above)")
def test_chmod_000_is_a_permission_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = _ckpt(tmp_path)
    (directory / "model.safetensors").chmod(0)
    try:
        with pytest.raises(CheckpointFormatError, match="permission denied"):
            load_checkpoint(directory, model=_bn_net())
        directory.chmod(0)
        code, _, err = cli(["ckpt", "verify", str(directory)], capsys)
        assert code == 2 and "permission denied" in err
        _one_paragraph(err)
    finally:
        directory.chmod(0o755)
        (directory / "model.safetensors").chmod(0o644)


def test_model_bytes_metadata_order_does_not_depend_on_the_process() -> None:
    """safetensors writes metadata from a hash map; the same weights give the same bytes.
    Its hash map's seed changes with each map (Rust's RandomState), not only with each
    process: 16 writes here (unsorted, 2 orders of the 2 keys, both seen) and one in
    another process."""
    import hashlib
    import subprocess
    import sys

    from torchgpu.checkpoint.layout import model_bytes

    code = ("import sys, torch, hashlib; from torchgpu.checkpoint.layout import model_bytes;"
            "w = torch.arange(12.).reshape(3, 4);"
            "b, _ = model_bytes({'a.weight': w, 'b.weight': w, 'c': torch.ones(2)});"
            "sys.stdout.write(hashlib.sha256(b).hexdigest())")
    w = torch.arange(12.).reshape(3, 4)
    digests = {hashlib.sha256(model_bytes({"a.weight": w, "b.weight": w, "c": torch.ones(2)})[0])
               .hexdigest() for _ in range(16)}
    digests.add(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               check=True, timeout=120).stdout)
    assert len(digests) == 1


def test_sorted_metadata_keeps_a_loadable_file() -> None:
    from safetensors.torch import load, save

    from torchgpu.checkpoint.layout import _sorted_metadata

    raw = save({"x": torch.ones(3)}, metadata={"z": "1", "a": "2", "m": "3"})
    fixed = _sorted_metadata(raw)
    assert len(fixed) == len(raw)
    assert b'{"__metadata__":{"a":"2","m":"3","z":"1"}' in fixed
    assert torch.equal(load(fixed)["x"], torch.ones(3))
    assert _sorted_metadata(b"junk") == b"junk"
