"""Plan before you run: which strategy fits a model on given devices, with the least slowdown.

- :mod:`~torchgpu.planning.targets`: device specs (``auto``, ``4x80GiB``, ``cuda:0,cuda:1``)
- :mod:`~torchgpu.planning.footprint`: a model's training memory, device-independent
- :mod:`~torchgpu.planning.measure`: the footprint from
  :func:`torchgpu.memory.estimate.estimate_memory`
- :mod:`~torchgpu.planning.candidates`: memory per device and step time of every strategy
- :mod:`~torchgpu.planning.workload`: what is being planned (model, data, batch, precision)
- :mod:`~torchgpu.planning.decide`: the choice ("fit with the least slowdown")
- :mod:`~torchgpu.planning.commands`: a plan as ``torchgpu train`` settings, command or Python
- :mod:`~torchgpu.planning.custom`: building and measuring a ``--model`` factory safely
- :mod:`~torchgpu.planning.planner`: :func:`plan_for_training`, :func:`plan_from_footprint`
- :mod:`~torchgpu.planning.report`: the ``torchgpu plan --json`` document

Names are imported from their modules (``from torchgpu.planning.planner import
plan_for_training``); this package file imports nothing, so it stays cheap.
"""
