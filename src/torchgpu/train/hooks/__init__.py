"""Code from outside the engine that acts at its hook points (``run_hooks``): a script's or a
test's own hooks, and the environment-activated plug-ins that reach the processes a
launcher starts (test-only: ``faults``, ``simulated_memory``).
"""
