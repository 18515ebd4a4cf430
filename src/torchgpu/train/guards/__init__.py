"""What keeps a run's ranks and its stop in step: the decisions every rank takes alike
without a collective per step (:mod:`.agreement`: the stop, the logged loss, finite
gradients), the bound on a stop's wait for its step boundary (:mod:`.stop_deadline`),
and ``--batch-size auto``, the largest micro-batch that fits, agreed by all ranks
(:mod:`.auto_batch`). The out-of-memory back-off replays the loop's window, so it is
part of the loop (:mod:`torchgpu.train.loop.backoff`).
"""
