"""The ``torchgpu`` command line: one module per verb, each with ``main(argv) -> int``."""
