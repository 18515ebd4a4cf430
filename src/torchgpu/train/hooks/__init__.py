"""Code from outside the engine that acts at its hook points (:mod:`.run_hooks`): a
script's or a test's own hooks, and the environment-activated plug-ins that reach the
processes a launcher starts — a planted crash or hang (:mod:`.faults`) and a device that
holds N samples for the batch-size search without a GPU (:mod:`.simulated_memory`).
"""
