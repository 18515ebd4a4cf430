"""torchgpu.data."""
