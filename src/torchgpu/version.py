"""torchgpu's version, and the versions a run records (:func:`versions`): a leaf module,
so the library's own modules (a run's summary and config file, a bench report) read it
without importing the package's public API."""

import platform
import sys

__version__ = "0.1.0"


def versions() -> dict[str, str]:
    """Versions of python, torch, torchgpu and the platform, for the summary."""
    import torch

    return {
        "torchgpu": __version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cuda": str(torch.version.cuda),
    }
