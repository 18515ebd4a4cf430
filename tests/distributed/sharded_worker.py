"""Worker for test_sharded_gloo: sharded checkpoints of an FSDP2 model on 2 gloo ranks.

``python -m torch.distributed.run ... sharded_worker.py MODE DIR``:

- ``roundtrip``: train 2 Adam steps, save ``DIR/ckpts/step-00000002`` (sync) and
  ``step-00000003`` after a third step (``--async``: async, the model changed while it is
  written), write every rank's gathered state to ``DIR/expected-N.pt`` (N the step),
  then load step 2 into a fresh FSDP2 model and optimizer and check both equal what was
  saved (``loaded ok`` on stdout).
- ``fail``: save step 1, then save step 2 with rank 1's shard write raising: every rank
  gets the one-paragraph error (``failed ok``).
- ``kill``: save step 1, then rank 1 dies (SIGKILL) while writing step 2's shards.
- ``load1``: load ``DIR/one/step-00000003`` (written by one process) into the FSDP2
  model and a fresh optimizer and check the gathered states equal
  ``DIR/one-expected.pt``.
"""

from __future__ import annotations

import copy
import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn

from torchgpu.checkpoint.sharded import ShardedSaver, load_sharded_states
from torchgpu.distributed import init_distributed
from torchgpu.errors import CheckpointWriteError
from torchgpu.parallel.data import wrap_data_parallel


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 1))


def train_step(model: nn.Module, optim: torch.optim.Optimizer, step: int, rank: int) -> None:
    gen = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)
    nn.functional.mse_loss(model(x), y).backward()
    optim.step()
    optim.zero_grad()


def full(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, object]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(model, optim, options=options)
    # deep copies: a value the gather does not copy (Adam's step) is the live tensor
    return copy.deepcopy({"model": model_state, "optim": optim_state})


def same(a: object, b: object, where: str = "") -> None:
    """``a`` and ``b`` equal bitwise: nested dicts/lists of tensors and plain values."""
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), (where, a.keys(), b.keys())
        for key in a:
            same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        assert len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{index}]")
    elif isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        assert torch.equal(a, b), (where, a, b)
    else:
        assert a == b, (where, a, b)


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    use_async = "--async" in sys.argv
    with init_distributed(backend="gloo") as env:
        rank, world = env.rank, env.world_size
        model = wrap_data_parallel(make_model(), "fsdp")
        optim = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.1)
        saver = ShardedSaver(rank=rank, world=world, async_save=use_async)
        ckpts = out / "ckpts"

        def save(step: int) -> Path:
            return saver.save(ckpts / f"step-{step:08d}", model=model, optimizer=optim,
                              step=step, epoch=0, extra={"rank_count": world}, meta={})

        for step in (1, 2):
            train_step(model, optim, step, rank)
        if mode == "roundtrip":
            save(2)
            expected = full(model, optim)
            if rank == 0:
                torch.save(expected, out / "expected-2.pt")
            train_step(model, optim, 3, rank)
            save(3)
            expected3 = full(model, optim)  # taken while step 3 may still be written
            train_step(model, optim, 4, rank)  # changes the model during an async write
            saver.wait()
            if rank == 0:
                torch.save(expected3, out / "expected-3.pt")
            fresh = wrap_data_parallel(make_model(), "fsdp")
            fresh_optim = torch.optim.Adam(fresh.parameters(), lr=1e-2, weight_decay=0.1)
            load_sharded_states(ckpts / "step-00000002", fresh, fresh_optim)
            got = full(fresh, fresh_optim)
            same(got, expected)
            print(f"rank {rank} loaded ok", flush=True)
        elif mode == "load1":  # a checkpoint one process wrote, loaded on two
            fresh_optim = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.1)
            load_sharded_states(out / "one" / "step-00000003", model, fresh_optim)
            got = full(model, fresh_optim)
            if rank == 0:
                same(got, torch.load(out / "one-expected.pt", weights_only=False))
            print(f"rank {rank} loaded ok", flush=True)
        elif mode in ("fail", "kill"):
            save(1) if mode == "fail" else saver.save(
                ckpts / "step-00000001", model=model, optimizer=optim, step=1, epoch=0)
            saver.wait()
            import torch.distributed.checkpoint as dcp

            original = dcp.FileSystemWriter.write_data

            def broken(self: object, *args: object, **kwargs: object) -> object:
                if rank == 1:
                    if mode == "kill":
                        os.kill(os.getpid(), signal.SIGKILL)
                    raise OSError(28, "No space left on device (planted)")
                return original(self, *args, **kwargs)  # type: ignore[arg-type]

            dcp.FileSystemWriter.write_data = broken  # type: ignore[method-assign]
            try:
                save(2)
                saver.wait()
            except CheckpointWriteError as error:
                assert "previous checkpoint is still the newest" in str(error), error
                print(f"rank {rank} failed ok: {error}", flush=True)
        saver.close()


if __name__ == "__main__":
    main()
