"""``python -m torchgpu``: the same as the ``torchgpu`` command."""

from torchgpu.cli.main import entry

if __name__ == "__main__":
    entry()
