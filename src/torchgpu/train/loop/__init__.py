"""The epoch loop, one path for every strategy (``epoch``; one micro-batch: ``micro_step``;
a window's losses: ``window``; the OOM back-off: ``backoff``).

It imports no strategy, checkpoint, observer or run driver: they hook in through
``parts.LoopParts`` (``on_step``; ``step``, a strategy's own micro-step: the loop's one
branch, taken by the multi-process stage pipeline) and the strategy's run steps.
"""
