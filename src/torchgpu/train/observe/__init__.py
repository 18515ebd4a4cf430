"""What watches a run without changing it: progress, ``--profile``, ``--log tensorboard``,
CUDA memory snapshots, the memory estimate beside the measured peak and the data-wait
share, all of them one object for the run driver (``observers``).
"""
