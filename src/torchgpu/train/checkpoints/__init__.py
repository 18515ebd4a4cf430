"""A run's checkpoints and where it starts: saving and loading them
(:mod:`.run_checkpoints`), the resume point decided before ``--out`` is written
(:mod:`.resume_plan`, :mod:`.autoresume`, :mod:`.finished`), a saved position checked
before use (:mod:`.saved_position`) and the fingerprints of the files a run was built
from (:mod:`.fingerprints`). The file format itself is :mod:`torchgpu.checkpoint`.
"""
