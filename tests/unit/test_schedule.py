"""The GPipe clock-cycle schedule as a pure table."""

from __future__ import annotations

import pytest

from torchgpu.parallel.schedule import (
    backward_cycles,
    bubble_fraction,
    clock_cycles,
    ideal_speedup,
    num_clocks,
)


@pytest.mark.parametrize(
    ("m", "n", "table"),
    [
        (1, 1, [[(0, 0)]]),
        (1, 3, [[(0, 0)], [(0, 1)], [(0, 2)]]),
        (3, 1, [[(0, 0)], [(1, 0)], [(2, 0)]]),
        (3, 2, [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(2, 1)]]),
        (
            4,
            3,
            [
                [(0, 0)],
                [(1, 0), (0, 1)],
                [(2, 0), (1, 1), (0, 2)],
                [(3, 0), (2, 1), (1, 2)],
                [(3, 1), (2, 2)],
                [(3, 2)],
            ],
        ),
        (2, 4, [[(0, 0)], [(1, 0), (0, 1)], [(1, 1), (0, 2)], [(1, 2), (0, 3)], [(1, 3)]]),
    ],
)
def test_clock_cycles_table(m: int, n: int, table: list[list[tuple[int, int]]]) -> None:
    assert list(clock_cycles(m, n)) == table
    assert len(table) == num_clocks(m, n)


@pytest.mark.parametrize("m", range(1, 9))
@pytest.mark.parametrize("n", range(1, 6))
def test_every_task_once_after_its_predecessor(m: int, n: int) -> None:
    done: dict[tuple[int, int], int] = {}
    for clock, tasks in enumerate(clock_cycles(m, n)):
        assert len({j for _, j in tasks}) == len(tasks)  # one task per stage per clock
        for i, j in tasks:
            assert (i, j) not in done
            if j > 0:
                assert done[(i, j - 1)] < clock  # input ready from the previous stage
            if i > 0:
                assert done[(i - 1, j)] < clock  # stage finished the previous micro-batch
            done[(i, j)] = clock
    assert set(done) == {(i, j) for i in range(m) for j in range(n)}


def test_backward_is_the_reverse() -> None:
    fwd = [t for tasks in clock_cycles(3, 2) for t in tasks]
    bwd = [t for tasks in backward_cycles(3, 2) for t in tasks]
    assert bwd == fwd[::-1]


def test_bubble_and_speedup() -> None:
    assert bubble_fraction(1, 2) == pytest.approx(0.5)
    assert bubble_fraction(4, 2) == pytest.approx(1 / 5)
    assert ideal_speedup(4, 2) == pytest.approx(1.6)
    assert ideal_speedup(1, 4) == pytest.approx(1.0)
    # more micro-batches always shrink the bubble
    assert all(bubble_fraction(m + 1, 3) < bubble_fraction(m, 3) for m in range(1, 20))


@pytest.mark.parametrize(("m", "n"), [(0, 1), (1, 0), (-1, 2)])
def test_bad_sizes(m: int, n: int) -> None:
    with pytest.raises(ValueError, match="m >= 1"):
        list(clock_cycles(m, n))
