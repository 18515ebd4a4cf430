"""The epoch loop, one path for every strategy: :mod:`.epoch` runs an epoch's
micro-batches, :mod:`.micro_step` one micro-batch (forward, loss, backward),
:mod:`.window` one accumulation window's losses and ``--on-nonfinite``, :mod:`.tail` the
sample-weighted last windows, :mod:`.parts` the types they share (a leaf).

Imports nothing from the run driver (:mod:`torchgpu.train.runner`) or the strategies.
"""
