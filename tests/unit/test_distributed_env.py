"""DistEnv parsing, init_distributed in one process, and the single-process helpers."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from torchgpu.collectives import agree_any, agree_max, agree_min, broadcast_object, rank_zero_print
from torchgpu.distributed import DistEnv, DistSession, free_port, init_distributed
from torchgpu.errors import ConfigError, NoDeviceError

_TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in _TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_no_world_size_means_single_process() -> None:
    env = DistEnv.from_env({})
    assert env == DistEnv(0, 0, 1, 1)
    assert env.is_main and not env.is_distributed
    assert DistEnv.from_env({"RANK": "3", "WORLD_SIZE": ""}) == DistEnv()


def test_torchrun_variables_are_read() -> None:
    env = DistEnv.from_env(
        {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    )
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (5, 1, 8, 4)
    assert env.is_distributed and not env.is_main


def test_missing_local_variables_default_to_one_machine() -> None:
    env = DistEnv.from_env({"RANK": "1", "WORLD_SIZE": "2"})
    assert env == DistEnv(rank=1, local_rank=1, world_size=2, local_world_size=2)


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({"WORLD_SIZE": "two", "RANK": "0"}, "WORLD_SIZE='two'"),
        ({"WORLD_SIZE": "2"}, "RANK"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2"),
        ({"WORLD_SIZE": "2", "RANK": "-1"}, "RANK=-1"),
        ({"WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE=0"),
        ({"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"},
         "LOCAL_RANK=3"),
        ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_WORLD_SIZE": "3"}, "LOCAL_WORLD_SIZE=3"),
        ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "x"}, "LOCAL_RANK='x'"),
    ],
)
def test_bad_variables_name_the_culprit(environ: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError) as info:
        DistEnv.from_env(environ)
    assert named in str(info.value)
    assert "torchrun" in str(info.value)


def test_init_without_torchrun_forms_no_group(clean_env: pytest.MonkeyPatch) -> None:
    session = init_distributed()
    assert isinstance(session, DistEnv) and session.backend is None
    assert session.env == DistEnv()
    with init_distributed() as env:
        assert env.world_size == 1 and env.is_main
    assert not dist.is_initialized()
    assert not torch.cuda.is_initialized()


def test_init_with_one_gloo_process_and_context_exit(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "1")
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", str(free_port()))
    with init_distributed(device="cpu") as env:
        assert isinstance(env, DistSession) and env.owns_group and env.backend == "gloo"
        assert dist.is_initialized() and dist.get_world_size() == 1
        # a second call reuses the group and does not own it
        again = init_distributed(device="cpu")
        assert not again.owns_group
        again.close()
        assert dist.is_initialized()
        # world size 1: the helpers stay local
        assert agree_any(True) and agree_min(4) == 4
    assert not dist.is_initialized()
    assert not torch.cuda.is_initialized()


def test_an_error_in_the_session_survives_a_failing_teardown(
        clean_env: pytest.MonkeyPatch) -> None:
    # A script's own exit code (SystemExit(3)) or exception must come out of the session
    # even when tearing the group down fails (a peer already gone).
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "1")
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", str(free_port()))
    real = dist.destroy_process_group

    def failing(*args: object, **kwargs: object) -> None:
        real()
        raise RuntimeError("Connection closed by peer")

    clean_env.setattr(dist, "destroy_process_group", failing)
    with pytest.raises(SystemExit) as stopped, init_distributed(device="cpu"):
        raise SystemExit(3)
    assert stopped.value.code == 3 and not dist.is_initialized()


def test_bad_backend_and_nccl_without_gpu(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="'tcp'"):
        init_distributed(backend="tcp")
    clean_env.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(NoDeviceError, match="gloo"):
        init_distributed(backend="nccl")
    assert not dist.is_initialized()


def test_init_reports_bad_environment(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("WORLD_SIZE", "2")
    clean_env.setenv("RANK", "7")
    with pytest.raises(ConfigError, match="RANK=7"):
        init_distributed()


def test_free_port_is_bindable() -> None:
    port = free_port()
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


def test_rank_zero_print(clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    rank_zero_print("hello", 1)
    clean_env.setenv("RANK", "1")
    rank_zero_print("hidden")
    assert capsys.readouterr().out == "hello 1\n"


def test_helpers_are_identity_without_a_group() -> None:
    assert agree_any(False) is False and agree_any(True) is True
    assert agree_min(3) == 3 and agree_max(-2) == -2
    payload = {"a": [1, 2]}
    assert broadcast_object(payload) is payload


def test_the_start_up_wait_counts_the_store_connection_too(
        clean_env: pytest.MonkeyPatch) -> None:
    """--startup-timeout bounds forming the group in all: a connection to the store that
    took 1 s leaves 0.5 s of a 1.5 s limit to wait for the peers, not 1.5 s more."""
    import sys
    import time
    from datetime import timedelta

    from torchgpu.errors import DistributedError

    # the module (torch.distributed's attribute of that name is the function)
    torch_rendezvous = sys.modules["torch.distributed.rendezvous"]

    def slow_rendezvous(url: str, rank: int, world: int, **kwargs: object) -> object:
        time.sleep(1.0)  # a store that took long to answer
        yield dist.HashStore(), rank, world

    clean_env.setattr(torch_rendezvous, "rendezvous", slow_rendezvous)
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "2")  # the other rank never comes
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", str(free_port()))
    began = time.monotonic()
    with pytest.raises(DistributedError, match="timed out waiting 1500 ms") as failed:
        init_distributed(device="cpu", startup_timeout=timedelta(seconds=1.5))
    assert time.monotonic() - began < 2.2  # 1.5 s and a little, not 2.5 s
    assert "1 of 2 arrived" in str(failed.value.__cause__)
    assert not dist.is_initialized()
