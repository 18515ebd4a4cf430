"""A run's checkpoints and where it starts: saving and loading them (``run_checkpoints``), the
resume point decided before ``--out`` is written (``resume_plan``, ``autoresume``,
``finished``, ``world_change``) and a saved position checked before use
(``saved_position``). The file format itself is :mod:`torchgpu.checkpoint`.
"""
