"""What a memory estimate says: :class:`DeviceMemory` per device (a rank or a pipeline
stage) and the :class:`MemoryEstimate` of a strategy, with its peak, whether it fits
given capacities, and its table; :func:`bytes_per_sample` for batch-size arithmetic."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from torchgpu.errors import ConfigError

GIB = 1024**3


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes one device (a rank, or a pipeline stage) needs for training.

    ``extra_bytes``: DDP gradient buckets, or FSDP's gathered (unsharded) weights of the
    two largest units. ``total_bytes`` is the sum of the five categories; ``peak_bytes``
    is the predicted high-water mark (it adds backward/step temporaries, see
    :func:`~torchgpu.memory.estimate.arithmetic.training_peak_bytes`) and is the number to
    compare with a device's memory. CUDA context (~0.3-0.5 GiB) is not included.
    ``layers`` is the ``[start, end)`` range of sequential layers a stage holds.
    """

    device: str
    parameters_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    extra_bytes: int
    peak_bytes: int
    total_bytes: int
    layers: tuple[int, int] | None = None


@dataclass(frozen=True)
class MemoryEstimate:
    """The estimate for every device of a strategy (see :func:`estimate_memory`)."""

    strategy: str
    optimizer: str
    precision: str
    batch_size: int
    micro_batch_size: int
    chunks: int
    activation_checkpointing: bool
    balance: tuple[int, ...] | None
    devices: tuple[DeviceMemory, ...]

    @property
    def peak_bytes(self) -> int:
        """The largest per-device peak: what the busiest device must hold."""
        return max(d.peak_bytes for d in self.devices)

    @property
    def total_bytes(self) -> int:
        """Summed over devices."""
        return sum(d.total_bytes for d in self.devices)

    def fits(self, capacity_bytes: int | Sequence[int]) -> bool:
        """Whether every device's peak fits its capacity (one number for all, or one each)."""
        caps = (
            [capacity_bytes] * len(self.devices)
            if isinstance(capacity_bytes, int)
            else list(capacity_bytes)
        )
        if len(caps) != len(self.devices):
            raise ConfigError(
                f"{len(caps)} capacities given for {len(self.devices)} devices: give one "
                "capacity, or one per device"
            )
        return all(d.peak_bytes <= c for d, c in zip(self.devices, caps, strict=True))

    def as_dict(self) -> dict[str, Any]:
        """Plain data for JSON output."""
        out = asdict(self)
        out["peak_bytes"] = self.peak_bytes
        out["total_bytes"] = self.total_bytes
        return out

    def format(self) -> str:
        """A fixed-width table in GiB, one row per device."""
        head = (
            f"{self.strategy}, batch {self.batch_size}"
            + (f" in {self.chunks} chunks" if self.chunks > 1 else "")
            + f", {self.precision}, {self.optimizer}"
            + (", activation checkpointing" if self.activation_checkpointing else "")
        )
        cols = ("device", "params", "grads", "optim", "activ", "extra", "peak")
        lines = [head, "  ".join(f"{c:>9}" for c in cols)]
        for d in self.devices:
            values = (
                d.parameters_bytes, d.gradients_bytes, d.optimizer_bytes,
                d.activations_bytes, d.extra_bytes, d.peak_bytes,
            )  # fmt: skip
            lines.append("  ".join([f"{d.device:>9}", *(f"{v / GIB:9.3f}" for v in values)]))
        return "\n".join(lines)


def bytes_per_sample(estimate: MemoryEstimate) -> float:
    """Activation bytes per sample on the busiest device (for batch-size arithmetic)."""
    return max(d.activations_bytes for d in estimate.devices) / max(estimate.batch_size, 1)
