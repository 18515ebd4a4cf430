"""``python -m torchgpu``: the same as the ``torchgpu`` command."""

if __name__ == "__main__":
    # The stop signals are taken over before anything else is imported (see
    # torchgpu.cli.signals): a SIGINT during the imports must not print a traceback,
    # and a torchgpu launcher starts its workers with the signals held until this line.
    from torchgpu.cli import signals

    signals.install()

    from torchgpu.cli.main import entry

    entry()
