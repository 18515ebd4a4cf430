"""The node watch's judgements on a rendezvous state, without processes: a peer whose
keep-alive stopped is lost (named with its rank, launcher pid and the step), one whose
workers ended by themselves is not; nodes giving another --nnodes are refused; a
rendezvous past --rdzv-timeout names how many nodes arrived; the flags' bounds."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any

import pytest

from torchgpu.errors import ConfigError, UsageError
from torchgpu.launch.nodes import NodesMissingError, NodeWatch
from torchgpu.launch.rendezvous import rdzv_conf
from torchgpu.launch.run import LaunchSpec, check_spec, torchrun_args
from torchgpu.train.config import TrainConfig
from torchgpu.train.config_checks import validate


@dataclasses.dataclass(frozen=True)
class Node:  # torch's _NodeDesc: hashable, printed as addr_pid_id
    addr: str
    pid: int
    local_id: int = 0

    def __repr__(self) -> str:
        return f"{self.addr}_{self.pid}_{self.local_id}"


class Store:
    """The few TCPStore calls the watch makes, on a dict."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def add(self, key: str, n: int) -> int:
        value = int(self.data.get(key, b"0")) + n
        self.data[key] = str(value).encode()
        return value

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(key in self.data for key in keys)


ME, PEER = Node("10.0.0.1", 100), Node("10.0.0.2", 200)


def _watch(stopped: list[bool]) -> NodeWatch:
    watch = NodeWatch("10.0.0.1:29400", "job", 2, 60.0, lambda: stopped.append(True),
                      steps=lambda: [7, 6])
    watch._store, watch._me = Store(), ME
    return watch


def _state(peer_beat_age_s: float, **extra: Any) -> SimpleNamespace:
    now = datetime.now(timezone.utc)
    return SimpleNamespace(round=3, complete=True, closed=False,
                           participants={ME: 0, PEER: 1}, wait_list=set(),
                           last_heartbeats={ME: now,
                                            PEER: now - timedelta(seconds=peer_beat_age_s)},
                           **extra)


def test_a_peer_whose_keep_alive_stopped_is_lost_and_named(
        capsys: pytest.CaptureFixture[str]) -> None:
    stopped: list[bool] = []
    watch = _watch(stopped)
    assert not watch._watch_round(_state(0.5))  # the round's participants are taken
    assert not watch._watch_round(_state(1.0)) and watch.lost is None
    assert watch._watch_round(_state(10.0))
    assert watch.lost is not None
    assert "node 1 (10.0.0.2, launcher pid 200) of 2 was lost after step 7" in watch.lost
    assert stopped == [True]  # this node's workers were ended
    assert watch.lost in capsys.readouterr().err


def test_a_peer_whose_workers_ended_by_themselves_is_no_loss() -> None:
    stopped: list[bool] = []
    watch = _watch(stopped)
    watch._watch_round(_state(0.5))
    watch._store.set(f"torchgpu.ended.job.{PEER!r}", "3")  # it wrote so for round 3
    assert not watch._watch_round(_state(10.0))
    assert watch.lost is None and not stopped
    watch._store.set(f"torchgpu.ended.job.{PEER!r}", "2")  # an earlier round's word
    watch._peer_ended = False
    assert watch._watch_round(_state(10.0)) and watch.lost is not None


def test_torchgpu_workers_are_left_to_stop_by_themselves() -> None:
    stopped: list[bool] = []
    watch = _watch(stopped)
    watch.end_on_loss = False
    watch._watch_round(_state(0.5))
    assert watch._watch_round(_state(10.0))
    assert watch.lost is not None and "--collective-timeout" in watch.lost and not stopped


def test_another_nnodes_in_the_store_is_refused_naming_both() -> None:
    watch = _watch([])
    watch._publish()
    watch._check_nnodes()  # only this node so far
    index = watch._store.add("torchgpu.nodes.job", 1)
    watch._store.set(f"torchgpu.node.job.{index}",
                     '{"nnodes": 3, "host": "node1", "pid": 4242}')
    with pytest.raises(UsageError, match=r"--nnodes 2.*node1 \(launcher pid 4242\).*--nnodes 3"):
        watch._check_nnodes()


def test_a_rendezvous_past_its_timeout_names_how_many_arrived() -> None:
    watch = _watch([])
    watch._in_rendezvous, watch._arrived = True, (1, 0)
    watch._check_deadline()  # not yet
    watch._deadline -= 120
    with pytest.raises(NodesMissingError, match=r"only 1 of 2 nodes arrived .* 1 missing"):
        watch._check_deadline()


def test_rdzv_timeout_bounds_and_torchrun_settings() -> None:
    with pytest.raises(UsageError, match=r"--rdzv-timeout 0 is out of range"):
        check_spec(LaunchSpec(rdzv_timeout_s=0))
    with pytest.raises(ConfigError, match=r"--rdzv-timeout -1 is out of range"):
        validate(TrainConfig(rdzv_timeout=-1))
    args = torchrun_args(LaunchSpec(nnodes=2, rdzv_endpoint="10.0.0.1:29400",
                                    rdzv_timeout_s=45), "x.py", [])
    assert f"--rdzv-conf={rdzv_conf(45)}" in args
    assert rdzv_conf(45) == "join_timeout=75,keep_alive_interval=1,keep_alive_max_attempt=3"
    assert not any(a.startswith("--rdzv-conf") for a in torchrun_args(LaunchSpec(), "x.py", []))


def test_one_node_lets_the_store_bind_its_own_port() -> None:
    # A port picked before torchrun binds it can be taken by another job in between (the
    # agent then waits 60 s on a store that never answers): one node asks for port 0.
    args = torchrun_args(LaunchSpec(nproc=2), "x.py", [])
    assert "--rdzv-endpoint=127.0.0.1:0" in args
    several = torchrun_args(LaunchSpec(nnodes=2, rdzv_endpoint="10.0.0.1:29400"), "x.py", [])
    assert "--rdzv-endpoint=10.0.0.1:29400" in several
