"""``--strategy pipeline --nproc N``: one pipeline stage per process, all of it here (the
strategy object, its run over ``torch.distributed.pipelining`` schedules, its state
gathered on rank 0). It builds on the one-process split (``strategies.split``).
"""
