"""torchgpu.bench."""
