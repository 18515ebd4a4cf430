"""`torchgpu launch`: one node on a free port, and two node agents on 127.0.0.1 meeting
through torchrun's c10d rendezvous to run an all-reduce."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests import procs
from tests.procs import free_port, run_cli

SCRIPT = """
import torch, torch.distributed as dist
from torchgpu import init_distributed
with init_distributed() as env:
    t = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(t)
    print(f"rank {env.rank} of {env.world_size}: sum {t.item():g}", flush=True)
"""


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "allreduce.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.slow
def test_launch_two_processes_on_one_node(tmp_path: Path) -> None:
    done = run_cli(["launch", "--nproc", "2", str(_script(tmp_path))])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "rank 0 of 2: sum 3" in done.stdout and "rank 1 of 2: sum 3" in done.stdout


@pytest.mark.slow
def test_two_node_agents_rendezvous_on_loopback(tmp_path: Path) -> None:
    script = _script(tmp_path)
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torchgpu", "launch", "--nnodes", "2", "--node-rank",
             str(rank), "--rdzv-endpoint", endpoint, "--nproc", "1", str(script)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=procs.test_env(),
        )
        for rank in (0, 1)
    ]
    outputs = []
    try:
        for agent in agents:
            out, err = agent.communicate(timeout=procs.START_S)
            outputs.append(out)
            assert agent.returncode == 0, err[-2000:]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    joined = "".join(outputs)
    assert "rank 0 of 2: sum 3" in joined and "rank 1 of 2: sum 3" in joined


def test_launch_bad_input_exits_2(tmp_path: Path) -> None:
    from torchgpu.cli.main import main

    assert main(["launch", "--nproc", "0", str(_script(tmp_path))]) == 2
    assert main(["launch", "--nnodes", "2", str(_script(tmp_path))]) == 2
    assert main(["launch", str(tmp_path / "missing.py")]) == 2
    # Not HOST:PORT: refused at once (torchrun's agent would retry the lookup until timeout).
    for endpoint in ("foo", "h:70000", "a b:1"):
        assert main(["launch", "--nnodes", "2", "--rdzv-endpoint", endpoint,
                     str(_script(tmp_path))]) == 2


def test_launch_without_script_names_only_script(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from torchgpu.cli.main import main

    with pytest.raises(SystemExit) as exited:
        raise SystemExit(main(["launch", "--nproc", "2"]))
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "required: SCRIPT." in err and "ARGS" not in err


@pytest.mark.slow
def test_failed_worker_exit_code_is_reported(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    done = run_cli(["launch", "--nproc", "2", str(bad)])
    assert done.returncode == 3
    assert "worker rank 1" in done.stderr
