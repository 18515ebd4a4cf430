"""torchgpu.train."""
