"""torchgpu's version: a leaf module, so the library's own modules (a run's summary, a
bench report) read it without importing the package's public API."""

__version__ = "0.1.0"
