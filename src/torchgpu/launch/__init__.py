"""Starting N processes under torchrun and keeping them: :mod:`~torchgpu.launch.run`
(torchrun on a free port), :mod:`~torchgpu.launch.stop` and
:mod:`~torchgpu.launch.stop_record` (how a stop reaches every process and is told from a
failure), :mod:`~torchgpu.launch.heartbeat` and :mod:`~torchgpu.launch.hang_watch` (a
hung rank named, every worker ended). It never imports the training engine
(:mod:`torchgpu.train`), which imports it.
"""
