"""The epoch loop, one path for every strategy: :mod:`.epoch` runs an epoch's
micro-batches, :mod:`.micro_step` one micro-batch (forward, loss, backward),
:mod:`.window` one accumulation window's losses and ``--on-nonfinite``, :mod:`.tail` the
sample-weighted last windows, :mod:`.backoff` the out-of-memory back-off that replays a
window in smaller pieces (from the random state of its start, :mod:`.random_state`);
:mod:`.parts` and :mod:`.outcome` are the types they share (leaves).

It imports no strategy, checkpoint, observer or run driver: they hook in through
:class:`~.parts.LoopParts` (``on_step``) and the strategy's run steps.
"""
