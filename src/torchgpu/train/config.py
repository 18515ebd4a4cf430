"""TrainConfig: every setting of ``torchgpu train`` as one frozen dataclass.

``TrainConfig`` holds what the user asked for (``None`` = "use the example's default"), and
:func:`resolve` fills those defaults. Both are pure (no device, no file system), so they run
before anything is created. The value checks live in ``config_checks``, because the modules
that own each concept (strategies, schedule, compile...) read ``TrainConfig``: this module
imports none of them.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass
from pathlib import Path

EXAMPLES: tuple[str, ...] = ("housing", "lenet", "resnet50")
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16", "auto")
ON_NONFINITE: tuple[str, ...] = ("stop", "skip")
PROGRESS_MODES: tuple[str, ...] = ("auto", "rich", "plain", "off")
LOG_FORMATS: tuple[str, ...] = ("jsonl", "tensorboard")  # tensorboard: jsonl + event files
#: --optimizer's built-in names (torchgpu.train.recipe.optimizers makes them; listed here, in
#: this torch-free leaf, for the CLI's help)
OPTIMIZER_NAMES: tuple[str, ...] = ("adam", "adamw", "sgd")
DEFAULT_PROFILE_STEPS = 5  # --profile without N
#: Largest --seed: torch.manual_seed takes up to 2**64-1 and numpy's generators any
#: non-negative integer; the loader seeds epoch e with seed + e, so stay below 2**63.
MAX_SEED = 2**63 - 1
#: Upper bound of counts such as --batch-size and --data-size (samples, steps): far above
#: any real run, and small enough that no size computed from it overflows int64.
MAX_COUNT = 2**31
#: Largest --collective-timeout (seconds, about 24.8 days): torch's store waits on its
#: sockets with poll() given the timeout as a 32-bit count of milliseconds (2**31 - 1 ms);
#: beyond that it overflows and a run fails at its rendezvous (and past ~9.2e9 s the
#: steady-clock deadline in nanoseconds, past ~8.6e13 s Python's timedelta).
MAX_COLLECTIVE_TIMEOUT_S = (2**31 - 1) // 1000


@dataclass(frozen=True)
class ExampleDefaults:
    """Defaults per built-in example: chosen so the default run is short and converges."""

    epochs: int
    batch_size: int
    lr: float  # the optimizer's learning rate


# housing: 404 training rows, batch 16 -> 26 steps/epoch; 40 epochs reach test R² >= 0.8 in a
# few seconds on a 2-core CPU (the `make demo` run).
EXAMPLE_DEFAULTS: dict[str, ExampleDefaults] = {
    "housing": ExampleDefaults(epochs=40, batch_size=16, lr=0.01),
    "lenet": ExampleDefaults(epochs=2, batch_size=64, lr=1e-3),
    "resnet50": ExampleDefaults(epochs=1, batch_size=8, lr=1e-3),
}
CSV_DEFAULTS = ExampleDefaults(epochs=40, batch_size=32, lr=0.01)
# --model SPEC: AdamW's usual learning rate for a user's network, a few epochs.
MODEL_DEFAULTS = ExampleDefaults(epochs=3, batch_size=16, lr=1e-3)


@dataclass(frozen=True)
class TrainConfig:
    """Every flag of ``torchgpu train``. ``None`` means "the example's default".

    Data: ``example`` (a built-in) or ``data`` (a CSV path) with ``target`` (its label
    column). ``data_size`` shrinks a built-in example (for quick runs and tests).
    """

    example: str | None = None
    data: str | None = None  # a CSV path, or with ``model`` a data spec (module:attr)
    model: str | None = None  # a model spec: module.path:attr or path/to/file.py:attr
    loss: str | None = None  # mse | cross_entropy | a module:function spec (with model)
    # adam | adamw | sgd (at lr) | a module:function spec (params -> Optimizer); None: the
    # task's default (Adam for the built-in examples, AdamW for a user's model)
    optimizer: str | None = None
    collate_fn: str | None = None  # with model: a spec naming the batches' collate function
    target: str | None = None
    data_size: int | None = None
    device: str = "auto"
    gpus: str | None = None
    nproc: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    max_restarts: int = 0
    rdzv_timeout: float = 600.0  # seconds a node waits for every node (several nodes)
    strategy: str = "auto"
    chunks: int | str | None = None  # an int, or "auto" (measured split-size sweep)
    devices: str | None = None  # model/pipeline stage devices, e.g. "cuda:0,cuda:1"
    balance: str | None = None  # layers per stage "3,2", or "size" / "time"
    schedule: str | None = None  # gpipe | 1f1b | interleaved1f1b (pipeline)
    auto_batch_size: bool = False  # --batch-size auto: search the largest micro-batch
    # samples per optimizer step over all processes: with a fixed batch_size the
    # accumulation follows (assemble), with auto the search keeps it
    effective_batch_size: int | None = None
    accumulate: int = 1
    # True: the model's repeated block (auto-detected); a class name: that block class
    activation_checkpointing: bool | str = False
    compile: bool = False  # torch.compile the model (torchgpu.train.recipe.compiling)
    compile_mode: str | None = None  # default | reduce-overhead | max-autotune | ...
    precision: str = "fp32"
    epochs: int | None = None
    # Optimizer steps per epoch of a streamed training set (torchgpu.data.stream).
    steps_per_epoch: int | None = None
    batch_size: int | None = None  # per process, per micro-batch
    lr: float | None = None
    clip_norm: float | None = None
    # The learning-rate schedule (torchgpu.train.schedule): constant | linear | cosine |
    # step, after warmup_steps optimizer steps of linear warm-up from 0; or a scheduler
    # spec (module:function, optimizer -> LRScheduler).
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    lr_step_size: int | None = None  # step: epochs between decays (default 1)
    lr_gamma: float | None = None  # step: the decay factor (default 0.1)
    scheduler: str | None = None
    seed: int = 0
    out: str | None = None
    # DataLoader processes per training process, or "auto" (torchgpu.data.workers:
    # several on CUDA, 0 on the CPU and for in-memory tensors); config.toml keeps "auto"
    # so a replay decides again on its machine, summary.json records the number.
    num_workers: int | str = "auto"
    save_every: int | None = None  # optimizer steps between checkpoints
    keep_last: int | None = None
    # sharded checkpoints (--strategy fsdp) are written while training goes on
    async_save: bool = False
    resume: str | None = None  # "" = the run's own `latest`; a path = that checkpoint/dir
    trust_checkpoint: bool = False  # --resume may run the full unpickler on state.pt
    # an --out holding a run's files: remove them (train.out_dir.clear_run) and start over
    overwrite: bool = False
    # --resume goes on although a file the run is built from (a spec's file, a CSV)
    # changed since the checkpoint was saved (torchgpu.train.fingerprints)
    force_resume: bool = False
    # continue the run in --out from its newest good checkpoint, or start it when there
    # is none; a finished run there is left as it is (train.resume_plan)
    autoresume: bool = False
    # step records written to metrics.jsonl every N optimizer steps (None: every
    # outputs.STEP_FLUSH_S seconds of training), not only at epoch ends
    log_every: int | None = None
    # evaluation metrics beside the task's: comma-separated built-in names
    # (train.metrics.BUILT_IN) or module:function specs, each reported as test_<name>
    metrics: str | None = None
    on_nonfinite: str = "stop"
    # Seconds a rank waits in a collective (gradient all-reduce, agreement, checkpoint
    # barrier) before the run is stopped and the rank that did not arrive is named.
    collective_timeout: float = 300.0
    # Seconds a rank waits for the others to form the process group (a peer still
    # building its model or loading its data) before the start-up fails.
    startup_timeout: float = 600.0
    # Seconds a stop (SIGTERM/SIGINT) may take to reach a step boundary before the run is
    # ended without it (a stuck data loader); a second signal shortens it.
    stop_timeout: float = 30.0
    progress: str = "auto"
    json: bool = False
    profile: int | None = None  # steps traced by torch.profiler after warm-up (--profile [N])
    log: str = "jsonl"  # jsonl | tensorboard (event files as well as metrics.jsonl)
    memory_snapshot: bool = False  # CUDA allocator history -> pickle + HTML under --out
    estimate_memory: bool = False  # the planner's estimate next to the measured peak

    @property
    def fixed_batch_size(self) -> int | None:
        """The batch size the run is held to: ``batch_size``, or None under ``--batch-size
        auto``, where the resolved ``batch_size`` is only where the search starts (the
        search fits the micro-batch to the data, so no check of the data against the
        default batch applies)."""
        return None if self.auto_batch_size else self.batch_size

    @property
    def run_name(self) -> str:
        """What the run trains: the model spec's name, the example name or the CSV's stem."""
        if self.model is not None:
            return self.model.rsplit(":", 1)[-1] or "model"
        if self.data is not None:
            return Path(self.data).stem or "csv"
        return self.example or "housing"


def defaults_for(config: TrainConfig) -> ExampleDefaults:
    """The defaults that apply to ``config``'s data (example or CSV) or user model."""
    if config.model is not None:
        return MODEL_DEFAULTS
    if config.data is not None:
        return CSV_DEFAULTS
    return EXAMPLE_DEFAULTS.get(config.example or "housing", CSV_DEFAULTS)


def default_out(config: TrainConfig, now: datetime.datetime | None = None) -> str:
    """``runs/<example>-<YYYYmmdd-HHMMSS>``, relative to the working directory."""
    stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    return str(Path("runs") / f"{config.run_name}-{stamp}")


def resolve(config: TrainConfig, now: datetime.datetime | None = None) -> TrainConfig:
    """``config`` with every ``None`` default filled: example, epochs, batch, lr, out.

    Call :func:`~torchgpu.train.config_checks.validate` first; resolving does not check values.
    """
    example = config.example if (config.example or config.data or config.model) else "housing"
    filled = dataclasses.replace(config, example=example)
    defaults = defaults_for(filled)
    return dataclasses.replace(
        filled,
        epochs=config.epochs if config.epochs is not None else defaults.epochs,
        batch_size=config.batch_size if config.batch_size is not None else defaults.batch_size,
        lr=config.lr if config.lr is not None else defaults.lr,
        out=config.out if config.out is not None else default_out(filled, now),
    )
