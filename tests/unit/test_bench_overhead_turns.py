"""The ``overhead`` suite's rotation: in each round every loop trains the same model copy,
and every copy is trained equally often."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

from torchgpu.bench.suites.overhead import (
    COPIES,
    Turns,
    make_batches,
    make_mlp,
    raw_loop,
    size_plans,
    torchgpu_loop,
)
from torchgpu.bench.timer import measure_interleaved


def test_every_variant_trains_the_same_copy_in_each_round() -> None:
    trained: list[tuple[str, int]] = []

    def epochs(name: str) -> list[Callable[[], None]]:
        return [lambda name=name, copy=copy: trained.append((name, copy))
                for copy in range(COPIES)]

    variants = {name: Turns(epochs(name)) for name in ("a", "b", "c")}
    rounds = 4 * COPIES
    measure_interleaved(variants, rounds, COPIES, seed=3)
    warm, timed = trained[:3 * COPIES], trained[3 * COPIES:]
    assert Counter(copy for _, copy in warm) == {c: 3 for c in range(COPIES)}
    for r in range(rounds):
        this_round = timed[3 * r:3 * r + 3]
        assert {name for name, _ in this_round} == {"a", "b", "c"}
        assert {copy for _, copy in this_round} == {r % COPIES}  # one copy for all
    assert Counter(copy for _, copy in timed) == {c: rounds // COPIES * 3
                                                  for c in range(COPIES)}


def test_the_loops_train_the_copies_they_are_given() -> None:
    device = torch.device("cpu")
    batches = make_batches(13, 8, 3, device)
    copies = [make_mlp("tiny")[0] for _ in range(COPIES)]
    first = [p.detach().clone() for p in copies[0].parameters()]
    assert all(torch.equal(a, b) for a, b in zip(first, copies[1].parameters(), strict=True))
    raw = Turns(raw_loop(copies, batches, device))
    ours = Turns(torchgpu_loop(copies, batches, device))
    raw()  # copy 0, with the raw loop's Adam
    ours()  # copy 0 again, with the torchgpu loop's own
    assert not any(torch.equal(a, b) for a, b in zip(first, copies[0].parameters(),
                                                     strict=True))
    assert all(torch.equal(a, b) for a, b in zip(first, copies[2].parameters(), strict=True))


def test_rounds_visit_every_copy_equally() -> None:
    for quick in (True, False):
        assert all(plan.rounds % COPIES == 0 for plan in size_plans(quick).values())
