"""torchgpu.models."""
