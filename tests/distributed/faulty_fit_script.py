"""A user's script: ``torchgpu.fit`` on :mod:`tests.distributed.faulty`'s task, for
``torchgpu launch --nproc N``. usage: faulty_fit_script.py OUT [key=value settings]
(``runs=K``: call fit K times in a row, each into OUT/run-<i>)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tests.*

from torch import nn

from tests.distributed.faulty import data, model
from torchgpu import fit

if __name__ == "__main__":
    out = Path(sys.argv[1])
    extra = dict(arg.split("=", 1) for arg in sys.argv[2:])
    runs = int(extra.pop("runs", "1"))
    settings = {k: int(v) if v.isdigit() else v for k, v in extra.items()}
    train, test = data()
    for i in range(runs):
        result = fit(model, train, eval_data=test, loss=nn.MSELoss(), optimizer="sgd", lr=0.05,
                     batch_size=4, out=str(out / f"run-{i}") if runs > 1 else str(out),
                     progress="off", seed=1, **{"epochs": 2, **settings})
        print(f"fit {i} done: world {result.summary['world_size']} steps "
              f"{result.summary['steps']}", flush=True)
