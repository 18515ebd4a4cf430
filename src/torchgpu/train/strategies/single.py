"""``--strategy single``: the whole model on one device, in one process."""

from __future__ import annotations

from torchgpu.train.strategies.base import Features, Strategy


class Single(Strategy):
    """One device, one process: the model moved there, nothing wrapped."""

    name = "single"
    help = "the whole model on one device"
    processes = "one"
    features = Features(estimate="single")


SINGLE = Single()
