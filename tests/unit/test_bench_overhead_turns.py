"""The ``overhead`` suite's rotation: in each round every loop trains the same model copy
with the same optimizer, and every copy is trained equally often."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

from torchgpu.bench.suites.overhead import (
    COPIES,
    Turns,
    copy_optimizers,
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


def test_the_loops_train_the_copies_they_are_given_with_the_copies_optimizers() -> None:
    device = torch.device("cpu")
    batches = make_batches(13, 8, 3, device)
    copies = [make_mlp("tiny")[0] for _ in range(COPIES)]
    first = [p.detach().clone() for p in copies[0].parameters()]
    assert all(torch.equal(a, b) for a, b in zip(first, copies[1].parameters(), strict=True))
    opts = copy_optimizers(copies)
    raw = Turns(raw_loop(copies, opts, batches, device))
    ours = Turns(torchgpu_loop(copies, opts, batches, device))
    raw()  # copy 0, with copy 0's Adam
    after_raw = opts[0].state_dict()["state"]
    assert {s["step"].item() for s in after_raw.values()} == {3.0}  # its state, 3 steps
    exp_avg = [s["exp_avg"] for s in opts[0].state.values()]
    ours()  # copy 0 again: the same Adam steps on, its state where it was in memory
    assert {s["step"].item() for s in opts[0].state.values()} == {6.0}
    assert all(a is s["exp_avg"] for a, s in zip(exp_avg, opts[0].state.values(),
                                                 strict=True))
    assert not opts[1].state and not opts[2].state  # the other copies' were not stepped
    assert not any(torch.equal(a, b) for a, b in zip(first, copies[0].parameters(),
                                                     strict=True))
    assert all(torch.equal(a, b) for a, b in zip(first, copies[2].parameters(), strict=True))


def test_rounds_visit_every_copy_equally() -> None:
    for quick in (True, False):
        assert all(plan.rounds % COPIES == 0 for plan in size_plans(quick).values())
