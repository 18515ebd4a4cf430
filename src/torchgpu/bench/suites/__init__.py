"""Benchmark suites, one module per suite; each exposes
``run(quick: bool, devices: Sequence[torch.device], out: Path, threads: int) -> SuiteResult``.

``threads`` is torch's intra-op thread count per process: the runner has already set it in
this process; suites that start worker processes give them the same count and record it
on the workers' measurements.

:data:`SUITES` maps the CLI name to the module, imported only when that suite runs.
"""

from __future__ import annotations

SUITES: dict[str, tuple[str, str]] = {
    "matmul": ("torchgpu.bench.suites.matmul", "CPU vs GPU TFLOP/s over matrix sizes"),
    "transfer": ("torchgpu.bench.suites.transfer", "host<->device GB/s, pinned, Prefetcher"),
    "parallel": ("torchgpu.bench.suites.parallel", "ResNet-50: one device vs split vs pipeline"),
    "split-sweep": ("torchgpu.bench.suites.split_sweep", "pipeline time over split sizes"),
    "dp-ddp": ("torchgpu.bench.suites.dp_ddp", "DataParallel vs DDP throughput and memory"),
    "checkpointing": ("torchgpu.bench.suites.activation_checkpointing",
                      "activation memory vs time"),
    "accumulation": ("torchgpu.bench.suites.accumulation", "memory vs micro-batch, fixed batch"),
    "overhead": ("torchgpu.bench.suites.overhead", "raw loop vs torchgpu vs Fabric/Accelerate"),
}
