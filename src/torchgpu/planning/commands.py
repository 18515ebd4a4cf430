"""A plan row as ``torchgpu train`` settings, as the command that runs it, or as Python.

:func:`train_settings` is the one translation from a plan row (a
:class:`~torchgpu.planning.candidates.Candidate`) to the settings of ``torchgpu train``
(:class:`~torchgpu.train.config.TrainConfig` field values). Both consumers go through it,
so they cannot disagree:

- ``torchgpu plan`` prints :func:`train_command` (``--example`` + the settings' flags);
- ``torchgpu train --strategy auto`` applies :meth:`TrainSettings.config_changes`.

Devices: a real device keeps its name; a hypothetical one (``gpuK`` from ``2x24GiB``)
becomes ``cuda:K``, the K-th GPU of the machine that runs the plan. Per strategy:

- ``single``: ``--device`` names the device (left out for ``cuda:0`` of a hypothetical
  machine, which ``--device auto`` picks);
- ``ddp``/``fsdp``: ``--nproc N``; ``--gpus`` only when the devices are not
  ``cuda:0..N-1`` (rank k trains on visible GPU k); ``--device cpu`` on the CPU;
- ``model``/``pipeline``: ``--devices`` (one per stage), ``--balance`` (always: the
  planner's cut, which may differ from train's even default), ``--chunks`` (pipeline);
- every strategy: ``--batch-size`` (micro-batch per process), ``--accumulate``,
  ``--activation-checkpointing`` (a pipeline row is priced with it: ``except_last``).

For a custom model (``--model module:factory``) the plan does not know the data or the
loss ``torchgpu train --model`` would need; :func:`python_snippet` writes the same
settings as calls of torchgpu's Python API.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torchgpu.planning.candidates import Candidate
from torchgpu.planning.targets import DeviceTarget
from torchgpu.planning.workload import Workload


@dataclass(frozen=True)
class TrainSettings:
    """The ``torchgpu train`` settings that run one plan row. Field names are
    :class:`~torchgpu.train.config.TrainConfig` fields; ``None`` = not set by the plan
    (the user's value or train's default stays)."""

    strategy: str
    batch_size: int
    accumulate: int
    activation_checkpointing: bool
    device: str | None = None
    gpus: str | None = None
    nproc: int | None = None
    devices: str | None = None
    balance: str | None = None
    chunks: int | None = None

    def config_changes(self) -> dict[str, object]:
        """TrainConfig field -> value for every setting the plan decides."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def argv(self) -> list[str]:
        """The ``torchgpu train`` flags for these settings (defaults left out)."""
        defaults = {"activation_checkpointing": False, "accumulate": 1, "device": "auto"}
        changes = self.config_changes()
        out: list[str] = []
        for name in _FLAG_ORDER:
            value = changes.get(name)
            if value is None or (name in defaults and value == defaults[name]):
                continue  # not set, or train's default: the flag would change nothing
            flag = "--" + name.replace("_", "-")
            out += [flag] if value is True else [flag, str(value)]
        return out


# Where the devices are, then how they are used, then the batch: as people write it.
_FLAG_ORDER = (
    "strategy", "device", "gpus", "nproc", "devices", "balance", "chunks",
    "batch_size", "accumulate", "activation_checkpointing",
)  # fmt: skip


def run_device(target: DeviceTarget) -> str:
    """The device name ``torchgpu train`` uses for ``target`` (``gpuK`` -> ``cuda:K``)."""
    if not target.real and target.kind == "cuda" and target.name.startswith("gpu"):
        return f"cuda:{target.name[3:]}"
    return target.name


def _used(candidate: Candidate, targets: Sequence[DeviceTarget]) -> list[DeviceTarget]:
    by_name = {t.name: t for t in targets}
    missing = [n for n in candidate.devices if n not in by_name]
    if missing:
        raise ValueError(f"plan row {candidate.label!r} names unknown devices {missing}")
    return [by_name[n] for n in candidate.devices]


def train_settings(candidate: Candidate, targets: Sequence[DeviceTarget]) -> TrainSettings:
    """The ``torchgpu train`` settings that run ``candidate`` on ``targets`` (rules in
    the module docstring). Pure."""
    used = _used(candidate, targets)
    names = [run_device(t) for t in used]
    common: dict[str, Any] = {
        "strategy": candidate.strategy,
        "batch_size": candidate.micro_batch,
        "accumulate": candidate.accumulate,
        "activation_checkpointing": candidate.checkpointing,
    }
    strategy = candidate.strategy
    if strategy == "single":
        device = names[0] if used and (used[0].real or names[0] != "cuda:0") else None
        return TrainSettings(**common, device=device)
    if strategy in ("ddp", "fsdp"):
        if used and used[0].kind == "cpu":
            return TrainSettings(**common, device="cpu", nproc=len(used))
        ids = [name.split(":", 1)[1] for name in names if name.startswith("cuda:")]
        identity = ids == [str(i) for i in range(len(ids))]
        gpus = None if identity or len(ids) != len(names) else ",".join(ids)
        return TrainSettings(**common, gpus=gpus, nproc=len(used))
    balance = ",".join(str(n) for n in candidate.balance) if candidate.balance else None
    return TrainSettings(
        **common,
        device="auto",  # --devices places every stage; train refuses --device with it
        devices=",".join(names),
        balance=balance,
        chunks=candidate.chunks if strategy == "pipeline" else None,
    )


#: The planner's optimizer names as ``torchgpu train --optimizer`` values; the others
#: (momentum, amsgrad, centered variants, none) take options no flag gives.
TRAIN_OPTIMIZERS = {
    "adam": "adam", "adamw": "adamw", "sgd": "sgd", "adamax": "torch.optim:Adamax",
    "nadam": "torch.optim:NAdam", "radam": "torch.optim:RAdam",
    "adagrad": "torch.optim:Adagrad", "rmsprop": "torch.optim:RMSprop",
}  # fmt: skip


def train_command(
    candidate: Candidate, workload: Workload, targets: Sequence[DeviceTarget]
) -> str | None:
    """The exact ``torchgpu train`` line for ``candidate``, which runs as printed:
    ``--example NAME``, or ``--model SPEC --data SPEC`` (with ``--loss`` and
    ``--collate-fn``) for a custom
    model planned with its data, then the plan's settings, ``--optimizer`` when one was
    asked for, ``--precision``. None where no such line would run (see
    :func:`python_snippet`): a custom model planned from an input shape, data of pairs
    without a loss, an optimizer no ``--optimizer`` value names."""
    if workload.example is not None:
        args = ["torchgpu", "train", "--example", workload.example]
    elif workload.model is not None and workload.data is not None:
        if workload.pairs and workload.loss is None:
            return None  # train would refuse it: pairs need a loss
        args = ["torchgpu", "train", "--model", workload.model, "--data", workload.data]
        if workload.loss is not None:
            args += ["--loss", workload.loss]
        if workload.collate_fn is not None:
            args += ["--collate-fn", workload.collate_fn]
    else:
        return None
    args += train_settings(candidate, targets).argv()
    if workload.optimizer_given:
        optimizer = TRAIN_OPTIMIZERS.get(workload.optimizer.lower().replace("-", "_"))
        if optimizer is None:
            return None
        args += ["--optimizer", optimizer]
    if workload.precision != "fp32":
        args += ["--precision", workload.precision]
    return shlex.join(args)


def _factory_code(spec: str) -> tuple[list[str], str]:
    """Import lines and the call that build the model ``spec`` names."""
    where, _, attribute = spec.rpartition(":")
    head, dot, rest = attribute.partition(".")
    if where.endswith(".py") or "/" in where or "\\" in where:
        lines = ["import runpy", f"{head} = runpy.run_path({where!r})[{head!r}]"]
    else:
        lines = [f"from {where} import {head}"]
    return lines, f"{head}{dot}{rest}()"


def python_snippet(
    candidate: Candidate, workload: Workload, targets: Sequence[DeviceTarget]
) -> str | None:
    """``candidate`` as Python for a custom model (``workload.model``, ``module:factory``):
    the torchgpu calls that set the model up, with the batch settings as comments.
    None for a built-in example (it has :func:`train_command`)."""
    if workload.model is None:
        return None
    settings = train_settings(candidate, targets)
    names = [run_device(t) for t in _used(candidate, targets)]
    imports, build = _factory_code(workload.model)
    api: set[str] = set()
    body: list[str] = []
    strategy = candidate.strategy
    checkpointing = ["apply_activation_checkpointing(model)"] if candidate.checkpointing else []
    if strategy == "single":
        body += [f"model = {build}.to({names[0]!r})", *checkpointing]
    elif strategy in ("ddp", "fsdp"):
        visible = f"CUDA_VISIBLE_DEVICES={settings.gpus} " if settings.gpus else ""
        device = "'cpu'" if settings.device == "cpu" else 'f"cuda:{env.local_rank}"'
        api |= {"init_distributed", "wrap_data_parallel"}
        body += [
            f"# run the script as: {visible}torchrun --nproc-per-node {len(names)} SCRIPT.py",
            "env = init_distributed()",
            f"model = {build}.to({device})",
            *checkpointing,
            f"model = wrap_data_parallel(model, {strategy!r})",
        ]
    elif strategy == "model":
        api.add("split_model")
        body.append(
            f"model = split_model({build}, devices={names!r}, "
            f"balance={list(candidate.balance or ())!r})"
        )
        if checkpointing:
            body.append("for stage in model.partitions:\n    apply_activation_checkpointing(stage)")
    else:  # a pipeline checkpoints through its own argument
        api.add("Pipeline")
        checkpoint = "except_last" if candidate.checkpointing else "never"
        checkpointing = []
        body.append(
            f"model = Pipeline({build}, devices={names!r}, "
            f"balance={list(candidate.balance or ())!r}, chunks={candidate.chunks}, "
            f"checkpoint={checkpoint!r})"
        )
    if checkpointing:
        api.add("apply_activation_checkpointing")
    batch = f"# batches of {candidate.micro_batch} samples"
    if strategy in ("ddp", "fsdp"):
        batch += " per process (DistributedSampler)"
    elif strategy in ("model", "pipeline"):
        batch += "; inputs to model.input_device, labels to model.output_device"
    body.append(batch)
    if candidate.accumulate > 1:
        api.add("GradAccumulator")
        body.append(
            f"accumulator = GradAccumulator(model, optimizer, steps={candidate.accumulate})"
            f"  # an optimizer step every {candidate.accumulate} batches"
        )
    if workload.precision != "fp32":
        api.add("Precision")
        first = "cuda" if not names or names[0].startswith("cuda") else names[0]
        body.append(f"precision = Precision({workload.precision!r}, {first!r})  # autocast")
    header = [f"from torchgpu import {', '.join(sorted(api))}"] if api else []
    return "\n".join([*imports, *header, *body])
