"""Checkpoints of GPU runs: saved from CUDA tensors, loaded on a CPU-only process and
back on the GPU; CUDA RNG streams round-trip."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from torchgpu.checkpoint import (
    capture_rng_state,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)

pytestmark = pytest.mark.gpu

CPU_ONLY_LOADER = textwrap.dedent("""
    import sys, torch
    from torch import nn
    from torchgpu.checkpoint import load_checkpoint
    assert not torch.cuda.is_available()
    torch.manual_seed(123)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters())
    loaded = load_checkpoint(sys.argv[1], model=model, optimizer=opt)
    expected = torch.load(sys.argv[2], weights_only=True)
    same = all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
    devices = {v.device.type for s in opt.state.values() for v in s.values()
               if torch.is_tensor(v)}
    print("OK" if same and devices == {"cpu"} and loaded.step == 3 else "BAD", flush=True)
""")


def _train_on_gpu() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).cuda()
    opt = torch.optim.Adam(model.parameters())
    for _ in range(3):
        loss = model(torch.randn(32, 8, device="cuda")).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, opt


def test_cuda_checkpoint_loads_in_a_cpu_only_process(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.procs import test_env as child_env

    model, opt = _train_on_gpu()
    save_checkpoint(tmp_path / "ck", model=model, optimizer=opt, step=3)
    state = torch.load(tmp_path / "ck" / "state.pt", weights_only=True, map_location="cpu")
    assert state["rng"]["cuda"] is not None  # CUDA was initialised, so its RNG was captured
    torch.save({k: v.cpu() for k, v in model.state_dict().items()}, tmp_path / "expected.pt")
    script = tmp_path / "load_cpu.py"
    script.write_text(CPU_ONLY_LOADER)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ck"), str(tmp_path / "expected.pt")],
        capture_output=True, text=True, timeout=180,
        env=child_env(CUDA_VISIBLE_DEVICES=""), check=False)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-2000:]


def test_cuda_checkpoint_loads_back_onto_the_gpu(tmp_path: Path) -> None:
    model, opt = _train_on_gpu()
    save_checkpoint(tmp_path / "ck", model=model, optimizer=opt)
    torch.manual_seed(1)
    fresh = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).cuda()
    fresh_opt = torch.optim.Adam(fresh.parameters())
    load_checkpoint(tmp_path / "ck", model=fresh, optimizer=fresh_opt, map_location="cuda:0")
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert b.is_cuda and torch.equal(a, b)
    # Adam keeps its "step" counter on the CPU unless capturable; the moments follow the params
    assert all(v.is_cuda for s in fresh_opt.state.values() for k, v in s.items() if k != "step")


def test_cuda_rng_round_trip() -> None:
    torch.cuda.init()
    state = capture_rng_state()
    assert state["cuda"] is not None and len(state["cuda"]) == torch.cuda.device_count()
    first = torch.rand(8, device="cuda").cpu()
    torch.rand(8, device="cuda")
    restore_rng_state(state)
    assert torch.equal(torch.rand(8, device="cuda").cpu(), first)
