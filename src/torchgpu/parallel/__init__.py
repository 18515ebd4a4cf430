"""torchgpu.parallel."""
