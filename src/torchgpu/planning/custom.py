"""Plan a user's model (``torchgpu plan --model module:factory``): build and measure it
safely, so that a failure is one paragraph (exit 2) and never a traceback.

The sample batch comes from ``--input-shape N,D,...[:DTYPE]`` (:func:`parse_input_shape`,
:func:`shape_sample`; integer dtypes for token ids) or from ``--data SPEC``
(:func:`sample_from_data`: ``batch`` items of the user's dataset, ``default_collate``-d,
as the training engine batches them).

The factory and the measured forward run under :func:`cuda_kept_on_cpu`: every request
for a CUDA device (``.to("cuda:1")``, ``.cuda()``, ``nn.Linear(..., device="cuda:0")``,
``torch.empty(..., device="cuda")``) keeps the tensor on the CPU. A model that places
its own layers (seed 002's ``seq1.to("cuda:0")`` / ``seq2.to("cuda:1")``) is thereby
measured like any other -- the memory the planner counts does not depend on where the
layers are, and the planner chooses the placement itself -- and no GPU is touched (a
CPU-only machine plans for hypothetical GPUs). Direct CUDA API calls
(``torch.cuda.current_device()``, streams) are not rewritten; a factory or forward that
makes them fails with a message that says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from torchgpu.device_rewrite import DeviceRewrite
from torchgpu.errors import DataError, TorchGpuError, UsageError, first_line
from torchgpu.planning.footprint import Footprint


def _on_cpu(device: object) -> object:
    """``device`` with CUDA replaced by the CPU; anything else unchanged."""
    if isinstance(device, str) and device.strip().lower().startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _KeepOnCpu(DeviceRewrite):
    """Rewrites CUDA device arguments to the CPU (see the module docstring)."""

    def device(self, value: object, index_is_device: bool) -> object:
        if index_is_device and isinstance(value, int) and not isinstance(value, bool):
            return "cpu"  # a GPU index
        return _on_cpu(value)

    def cuda(self, tensor: torch.Tensor, device: object) -> object:
        return tensor  # stays where it is: on the CPU (or meta)


@contextlib.contextmanager
def cuda_kept_on_cpu() -> Iterator[None]:
    """Within the block, tensors asked to go to (or be made on) CUDA stay on the CPU."""
    with _KeepOnCpu():
        yield


def _gpu_hint(error: BaseException) -> str:
    """Why a CUDA-looking failure happens while planning, or "" for other errors."""
    if "cuda" not in str(error).lower():
        return ""
    return (
        " Planning runs the factory and one forward on the CPU, with placements on cuda:N "
        "kept there, so they must not call the CUDA runtime directly (torch.cuda.* "
        "functions, streams)."
    )


#: ``--input-shape ...:DTYPE`` names (torch's own names, and the usual aliases).
INPUT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float": torch.float32, "float16": torch.float16,
    "half": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "int64": torch.int64, "long": torch.int64, "int32": torch.int32, "int": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}  # fmt: skip


def parse_input_shape(text: str) -> tuple[tuple[int, ...], torch.dtype]:
    """``"2,3,128,128"`` -> ``((2, 3, 128, 128), float32)``; ``"2,128:int64"`` ->
    ``((2, 128), int64)``. UsageError unless positive integers and a known dtype."""
    dims, sep, dtype_name = text.partition(":")
    try:
        shape = tuple(int(part) for part in dims.split(","))
    except ValueError:
        shape = ()
    if not shape or any(dim < 1 for dim in shape):
        raise UsageError(
            f"--input-shape {text!r} is not understood: give the sample batch's shape as "
            "positive integers, batch first, and a dtype for non-float inputs, e.g. "
            "--input-shape 2,3,128,128 or --input-shape 2,128:int64 (token ids)"
        )
    dtype_name = dtype_name.strip().lower() if sep else "float32"
    if dtype_name not in INPUT_DTYPES:
        raise UsageError(
            f"--input-shape {text!r}: dtype {dtype_name!r} is not known; use one of "
            f"{', '.join(INPUT_DTYPES)}, e.g. --input-shape 2,128:int64"
        )
    return shape, INPUT_DTYPES[dtype_name]


def shape_sample(shape: tuple[int, ...], dtype: torch.dtype, batch: int) -> torch.Tensor:
    """A sample of ``batch`` rows of ``shape[1:]``: a meta tensor (shapes only, nothing
    allocated). Integer inputs need no valid values: the planner measures on fake
    tensors, which have none (an embedding lookup only needs the index's shape)."""
    return torch.empty(batch, *shape[1:], dtype=dtype, device="meta")


def sample_from_data(spec: str, batch: int, collate_spec: str | None = None
                     ) -> tuple[object, bool]:
    """The model's inputs for ``batch`` items of the training data ``spec`` names
    (:func:`torchgpu.factories.resolve_data`), and whether they are a dict batch.

    The first ``batch`` items (cycling over a smaller dataset) are collated with
    ``default_collate``: dict items give one dict (``model(**batch)``, its loss from
    ``output.loss``), ``(inputs, target)`` items give ``inputs``. ``collate_spec``
    (``--collate-fn``) names the function that batches them instead
    (:func:`torchgpu.data.collate.resolve_collate`), e.g. one that pads token sequences
    of different lengths. Raises DataError (exit 2) for items that are neither or do not
    collate (naming the shapes that differ), UsageError for a bad spec or a collate
    function that fails.
    """
    from torchgpu.data.collate import Collate, resolve_collate
    from torchgpu.factories import resolve_data

    collate = Collate(resolve_collate(collate_spec) if collate_spec else None,
                      f"--collate-fn {collate_spec}")

    train, _ = resolve_data(spec)
    try:
        if hasattr(train, "__len__"):
            n = len(train)
            if n == 0:
                raise DataError(f"--data {spec}: the training data is empty; check the data")
            items = [train[i % n] for i in range(batch)]
        else:  # an iterable dataset: its first items
            stream = iter(train)
            items = [item for _, item in zip(range(batch), stream, strict=False)]
            if not items:
                raise DataError(f"--data {spec}: the training data is empty; check the data")
            items = [items[i % len(items)] for i in range(batch)]
        collated = collate(items)
    except DataError as error:  # items that do not stack: which shapes, and the fix
        raise DataError(f"--data {spec}: {error}") from None
    except TorchGpuError:
        raise
    except Exception as error:
        raise DataError(
            f"--data {spec}: {batch} items of the training data do not form a batch "
            f"({first_line(error)}). Items must be (inputs, target) pairs or dicts of "
            "tensors of equal shapes, as default_collate batches them."
        ) from None
    if isinstance(collated, Mapping):
        return collated, True
    if isinstance(collated, tuple | list) and len(collated) == 2:
        return collated[0], False
    raise DataError(
        f"--data {spec}: its items are {type(items[0]).__name__}s, neither (inputs, target) "
        "pairs nor dicts: return (inputs, target) from __getitem__, or a dict such as "
        "{'input_ids': ..., 'labels': ...} for a model that computes its own loss."
    )


def describe_sample(sample: object) -> str:
    """``shape 2,9`` for a tensor; ``input_ids 2x12 int64, labels 2x12 int64`` for a
    dict; the tensors in order for a tuple."""
    from torchgpu.memory.estimate.activations import tensor_leaves

    def one(t: torch.Tensor) -> str:
        dtype = str(t.dtype).removeprefix("torch.")
        return "x".join(str(d) for d in t.shape) + ("" if dtype == "float32" else f" {dtype}")

    if isinstance(sample, torch.Tensor):
        return f"shape {','.join(str(d) for d in sample.shape)}"
    if isinstance(sample, Mapping):
        return ", ".join(f"{k} {one(v) if isinstance(v, torch.Tensor) else type(v).__name__}"
                         for k, v in sample.items())
    return ", ".join(one(t) for t in tensor_leaves(sample))


def build_custom_model(spec: str) -> nn.Module:
    """Resolve ``spec`` (``module:factory``, see :func:`torchgpu.factories.resolve_model`)
    and build the model on the CPU.

    Raises :class:`UsageError` (exit 2) naming the spec and the failure when the spec
    cannot be resolved, the factory raises, or it returns something else than an
    ``nn.Module``.
    """
    from torchgpu.factories import resolve_model

    try:
        with cuda_kept_on_cpu():
            return resolve_model(spec)
    except UsageError as error:
        cause = error.__cause__
        hint = _gpu_hint(cause) if cause is not None else ""
        if not hint:
            raise
        raise UsageError(f"{error}{hint}") from cause


def measure_custom_model(
    model: nn.Module,
    spec: str,
    sample_batch: object,
    optimizer: str = "adam",
    precision: str = "fp32",
    source: str = "--input-shape",
) -> Footprint:
    """:func:`torchgpu.planning.measure.measure_footprint` of a ``--model`` model, with
    a forward that fails (a wrong ``--input-shape`` or ``--data``, named by ``source``;
    a GPU-only call) reported as a :class:`UsageError` naming the module that was
    running; torch's own log lines about the failed operation are silenced. Errors of
    torchgpu (unknown optimizer...) pass."""
    from torchgpu.placement import quiet_fake_tensor_logs
    from torchgpu.planning.measure import measure_footprint

    running: list[str] = []
    handles: list[RemovableHandle] = []

    def enter(name: str) -> Callable[[nn.Module, tuple[object, ...]], None]:
        def hook(_module: nn.Module, _args: tuple[object, ...]) -> None:
            running.append(name)

        return hook

    def leave(_module: nn.Module, _args: tuple[object, ...], _out: object) -> None:
        if running:
            running.pop()

    for name, module in model.named_modules():
        if name:
            handles.append(module.register_forward_pre_hook(enter(name)))
            handles.append(module.register_forward_hook(leave))
    try:
        with quiet_fake_tensor_logs(), cuda_kept_on_cpu():
            return measure_footprint(model, sample_batch, optimizer=optimizer, precision=precision)
    except TorchGpuError:
        raise
    except Exception as error:
        where = f" in {running[-1]}" if running else ""
        check = (
            "Check --input-shape (the shape of a sample batch, batch first, as the model's "
            "forward takes it, with :int64 for token ids)"
            if source == "--input-shape"
            else f"Check that {source}'s batches are what the model's forward takes "
            "(dicts are passed as model(**batch), pairs as model(inputs))"
        )
        raise UsageError(
            f"--model {spec}: the forward on a batch of {describe_sample(sample_batch)} "
            f"failed{where}: {first_line(error)}. {check} and the forward's "
            f"code.{_gpu_hint(error)}"
        ) from None
    finally:
        for handle in handles:
            handle.remove()
