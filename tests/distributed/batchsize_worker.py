"""Worker for test_batchsize_gloo: each rank simulates a different memory limit.

Rank r fits ``limits[r] // bytes_per_sample`` samples. Every rank prints one JSON line:
the batch-size search result, the probes it walked, and the OOM back-off decisions
taken when only rank 1 runs out of memory.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from torchgpu.distributed import init_distributed
from torchgpu.memory.batch_size_search import find_batch_size
from torchgpu.memory.oom import OOMBackoff


def main() -> None:
    limits = [int(v) for v in sys.argv[1].split(",")]
    bytes_per_sample = int(sys.argv[2])
    with init_distributed(backend="gloo") as env:
        limit = limits[env.rank]

        def try_step(batch: int) -> None:
            if batch * bytes_per_sample > limit:
                raise torch.OutOfMemoryError(f"rank {env.rank}: {batch} does not fit")

        result = find_batch_size(try_step, start=4)  # default agree: agree_min over gloo

        # OOM back-off: only rank 1 fails at micro-batches above 8; both must follow.
        backoff = OOMBackoff(32, 1)
        steps = []
        while True:
            error = None
            try:
                if env.rank == 1 and backoff.micro_batch > 8:
                    raise torch.OutOfMemoryError("rank 1 out of memory")
            except torch.OutOfMemoryError as caught:
                error = caught
            decision = backoff.check(error)
            if decision is None:
                break
            steps.append([decision.micro_batch, decision.accumulate])
        line = json.dumps(
            {
                "rank": env.rank,
                "size": result.size,
                "probes": [[p.size, p.fits] for p in result.probes],
                "backoff": steps,
            }
        )
        # One os.write of line + newline: ranks share stdout, and a print() under
        # PYTHONUNBUFFERED writes text and newline separately, so lines could interleave.
        os.write(1, (line + "\n").encode())


if __name__ == "__main__":
    main()
