"""Benchmark suites, one module per suite; each exposes
``run(quick: bool, devices: Sequence[torch.device], out: Path) -> SuiteResult``.

:data:`SUITES` maps the CLI name to the module, imported only when that suite runs.
"""

from __future__ import annotations

SUITES: dict[str, tuple[str, str]] = {
    "matmul": ("torchgpu.bench.suites.matmul", "CPU vs GPU TFLOP/s over matrix sizes"),
    "transfer": ("torchgpu.bench.suites.transfer", "host<->device GB/s, pinned, Prefetcher"),
    "parallel": ("torchgpu.bench.suites.parallel", "ResNet-50: one device vs split vs pipeline"),
    "split-sweep": ("torchgpu.bench.suites.split_sweep", "pipeline time over split sizes"),
    "dp-ddp": ("torchgpu.bench.suites.dp_ddp", "DataParallel vs DDP throughput and memory"),
    "checkpointing": ("torchgpu.bench.suites.checkpointing", "activation memory vs time"),
    "accumulation": ("torchgpu.bench.suites.accumulation", "memory vs micro-batch, fixed batch"),
    "overhead": ("torchgpu.bench.suites.overhead", "raw loop vs torchgpu vs Fabric/Accelerate"),
}
