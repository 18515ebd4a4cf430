"""Telling safetensors from pickles by their bytes: a safetensors header length ending in
byte 0x80 (one file in 256) starts like a pickle's PROTO opcode, and must still load
everywhere a safetensors file is read (load_state_dict, load_checkpoint, ckpt inspect,
train --resume); real pickles of every protocol stay pickles."""

from __future__ import annotations

import io
import pickle
import struct
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from torchgpu.checkpoint import inspect_checkpoint, load_checkpoint, load_state_dict
from torchgpu.checkpoint.api import canonical_state
from torchgpu.checkpoint.layout import model_bytes
from torchgpu.checkpoint.readers import sniff
from torchgpu.cli.main import main


def cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(args)
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def _header_length(data: bytes) -> int:
    return int(struct.unpack("<Q", data[:8])[0])


class _Named(nn.Module):
    """A buffer whose name length sets the safetensors header length."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("w" * n, torch.arange(2.0))


def _file_with_header_0x80(path: Path) -> _Named:
    for n in range(1, 400):
        save_file({"w" * n: torch.arange(2.0)}, str(path))
        if _header_length(path.read_bytes()) % 256 == 0x80:
            return _Named(n)
    raise AssertionError("no name length gives a header length of 0x80 mod 256")


def test_safetensors_whose_header_length_starts_like_a_pickle_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "model.safetensors"
    model = _file_with_header_0x80(path)
    assert path.read_bytes()[0] == 0x80  # the pickle PROTO opcode
    assert sniff(path) == "safetensors"
    load_state_dict(model, path)
    assert torch.equal(next(iter(model.buffers())), torch.arange(2.0))
    load_checkpoint(path, model=_Named(len(next(iter(model.state_dict())))))
    assert inspect_checkpoint(path)["num_tensors"] == 1
    code, out, err = cli(["ckpt", "inspect", str(path)], capsys)
    assert code == 0 and "safetensors" in out, err
    renamed = tmp_path / "model.pt"  # the name does not decide; the bytes do
    renamed.write_bytes(path.read_bytes())
    assert sniff(renamed) == "safetensors"


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_pickles_stay_pickles(protocol: int, tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    for n in range(1, 60):
        state = {"k" * n: torch.zeros(n % 5), "braces": "{" * n, "n": n, "f": n * 1.7e-300}
        buffer = io.BytesIO()
        torch.save(state, buffer, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
        path.write_bytes(buffer.getvalue())
        assert sniff(path) == "pickle", (n, buffer.getvalue()[:10])
        path.write_bytes(pickle.dumps({"k" * n: n, "s": "{" * n}, protocol=protocol))
        assert sniff(path) == "pickle", n


_SPEC = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

N = {n}

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 1)
        self.register_buffer("b" * N, torch.arange(2.0))

    def forward(self, x):
        return self.lin(x)

def make():
    return Net()

def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 3, generator=g)
    y = x.sum(1, keepdim=True)
    return TensorDataset(x[:24], y[:24]), TensorDataset(x[24:], y[24:])
"""


def test_resume_from_a_checkpoint_whose_header_length_starts_like_a_pickle(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    namespace: dict[str, object] = {}
    for n in range(1, 400):
        spec = tmp_path / f"net{n}.py"
        spec.write_text(textwrap.dedent(_SPEC.format(n=n)))
        exec(compile(spec.read_text(), str(spec), "exec"), namespace)
        data, _ = model_bytes(canonical_state(namespace["make"]()))  # type: ignore[operator]
        if _header_length(data) % 256 == 0x80:
            break
        spec.unlink()
    else:
        raise AssertionError("no buffer name gives a header length of 0x80 mod 256")
    out = tmp_path / "run"
    args = ["train", "--model", f"{spec}:make", "--data", f"{spec}:data", "--loss", "mse",
            "--batch-size", "8", "--device", "cpu", "--save-every", "2", "--out", str(out)]
    code, _, err = cli([*args, "--epochs", "1"], capsys)
    assert code == 0, err
    ckpt = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    assert (ckpt / "model.safetensors").read_bytes()[0] == 0x80
    assert load_checkpoint(out, model=namespace["make"]()).step == 2  # type: ignore[operator]
    code, _, err = cli(["ckpt", "inspect", str(out)], capsys)
    assert code == 0, err
    code, _, err = cli([*args[:-1], str(tmp_path / "more"), "--epochs", "2", "--resume",
                        str(out)], capsys)
    assert code == 0 and f"resuming from {ckpt}" in err, err
