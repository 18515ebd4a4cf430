"""What watches a run without changing it: the progress display (:mod:`.progress`),
``--profile`` (:mod:`.profiler`), ``--log tensorboard`` (:mod:`.tensorboard`), CUDA
memory snapshots (:mod:`.memory_snapshot`), the memory estimate beside the measured peak
(:mod:`.memory_report`), the data-wait share (:mod:`.data_wait`), and all of them as one
object for the run driver (:mod:`.observers`).
"""
