"""``--strategy pipeline --nproc N``: one pipeline stage per process, all of it here: the
strategy object (:mod:`.strategy`), its run over ``torch.distributed.pipelining``
schedules (:mod:`.run`) and its state gathered on rank 0 for checkpoints
(:mod:`.state`). It builds on the one-process split (:mod:`..split`).
"""
