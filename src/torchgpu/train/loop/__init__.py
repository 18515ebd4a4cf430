"""The epoch loop, one path for every strategy (``epoch``; one micro-batch: ``micro_step``;
a window's losses: ``window``; the OOM back-off: ``backoff``).

It imports no strategy, checkpoint, observer or run driver: they hook in through
``parts.LoopParts`` (``on_step``) and the strategy's run steps.
"""
