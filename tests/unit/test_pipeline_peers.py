"""Pipeline, split, micro-batching, balance and deferred BatchNorm against peer
behaviour: the cases a GPipe implementation is expected to handle, on CPU stages.

Where torchgpu deliberately differs from the peer, the test asserts torchgpu's
documented behaviour and says why. Peer cases not carried over, one line each:

- CUDA copy/wait streams, stream-recording, worker threads, fork/join "phony" tensors
  and the skip-connection API: peer internals with no torchgpu counterpart (torchgpu
  runs stages in clock order in one thread; its stream handling has GPU tests).
- checkpointing/recomputing flags queried from inside a layer: torchgpu exposes none.
- the deprecated balance package import: nothing of the kind exists here.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchgpu.errors import BalanceError, ConfigError, MicroBatchTypeError, PlacementError
from torchgpu.parallel.balance import balance_by_size, balance_by_time, solve_partition
from torchgpu.parallel.batchnorm import DeferredBatchNorm, convert_deferred_batch_norm
from torchgpu.parallel.microbatch import batch_size, gather, scatter
from torchgpu.parallel.model import split_model
from torchgpu.parallel.pipeline import Pipeline
from torchgpu.parallel.schedule import clock_cycles

CPU1, CPU2 = ["cpu"], ["cpu", "cpu"]
MODES = ["never", "except_last", "always"]


def linear(seed: int = 0, n: int = 1) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(1, 1) for _ in range(n)])


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameter gradients by the plain model's names (a pipeline's start with module.)."""
    out = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        out[name.removeprefix("module.")] = p.grad
    return out


def assert_transparent(ref: nn.Module, pipe: nn.Module, x: Any, *, input_grad: bool = True
                       ) -> None:
    """``pipe`` gives ``ref``'s output, input gradient and parameter gradients."""

    def prepared() -> Any:
        if isinstance(x, torch.Tensor):
            t = x.clone()
            return t.requires_grad_() if input_grad and t.is_floating_point() else t
        return copy.deepcopy(x)

    x_ref, x_pipe = prepared(), prepared()
    out_ref, out = ref(x_ref), pipe(x_pipe)
    torch.testing.assert_close(out, out_ref)
    (out_ref * torch.arange(1.0, out_ref.shape[-1] + 1)).sum().backward()
    (out * torch.arange(1.0, out.shape[-1] + 1)).sum().backward()
    if isinstance(x, torch.Tensor) and x_ref.requires_grad:
        torch.testing.assert_close(x_pipe.grad, x_ref.grad)
    want, got = grads(ref), grads(pipe)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)


class Counter(nn.Module):
    """Identity counting its forward calls (recomputation included)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x


class Expected(Exception):
    pass


class Raise(nn.Module):
    def forward(self, x: Any) -> Any:
        raise Expected()


# ======================================================================= construction
def test_parameters_are_the_models() -> None:
    model = linear()
    pipe = Pipeline(model, CPU1)
    assert list(pipe.parameters()) == list(model.parameters()) != []


def test_public_attributes_are_plain_values() -> None:
    pipe = Pipeline(linear(), ("cpu",), balance=(1,), chunks=42.0, checkpoint="always")
    assert pipe.balance == (1,) and pipe.devices == (torch.device("cpu"),)
    assert pipe.chunks == 42 and type(pipe.chunks) is int  # a whole float is a count
    assert pipe.checkpoint == "always"
    assert type(Pipeline(linear(), CPU1, chunks=np.int64(3)).chunks) is int


@pytest.mark.parametrize("balance", [[2], [1, 1]])
def test_sequence_of_layers_like_the_sequential(balance: list[int]) -> None:
    a, b = nn.Linear(1, 1), nn.Linear(1, 1)
    pipe = Pipeline(nn.Sequential(a, b), ["cpu"] * len(balance), balance=balance)
    assert len(pipe) == 2 and list(pipe) == [a, b]
    assert pipe[0] is a and pipe[1] is b and pipe[-1] is b and pipe[-2] is a
    for bad in (2, -3):
        with pytest.raises(IndexError, match="out of range for 2 layers"):
            pipe[bad]
    with pytest.raises(TypeError, match="indices are layer positions"):
        pipe["a"]  # type: ignore[index]


def test_a_repeated_layer_counts_at_each_position() -> None:
    act = nn.Tanh()
    pipe = Pipeline(nn.Sequential(nn.Linear(2, 2), act, nn.Linear(2, 2), act), CPU2)
    assert len(pipe) == 4 and pipe[1] is act and pipe[3] is act


@pytest.mark.parametrize("balance", [[1], [3], [0, 2], [-1, 3], [1.0, 1.0]])
def test_bad_balance_is_refused(balance: list[Any]) -> None:
    with pytest.raises(BalanceError) as info:
        Pipeline(linear(n=2), ["cpu"] * len(balance), balance=balance)
    assert isinstance(info.value, ValueError) and "try balance=" in str(info.value)


def test_balance_as_numpy_counts() -> None:
    assert Pipeline(linear(n=3), CPU2, balance=np.array([2, 1])).balance == (2, 1)
    assert split_model(linear(n=3), CPU2, balance=[np.int64(1), np.int64(2)]).balance == (1, 2)


def test_more_stages_than_devices_is_refused() -> None:
    # Deliberate: the peer raises IndexError; here a BalanceError (a ValueError) names both.
    with pytest.raises(BalanceError, match="4 stages but 1 devices"):
        Pipeline(linear(n=4), CPU1, balance=[1, 1, 1, 1])


def test_extra_devices_are_refused_not_dropped() -> None:
    # Deliberate: the peer silently drops devices beyond the balance; torchgpu asks for
    # one layer count per device, so a typo in either list is not hidden.
    with pytest.raises(BalanceError, match="3 stages but 5 devices"):
        Pipeline(linear(n=5), ["cpu"] * 5, balance=[2, 2, 1])
    with pytest.raises(BalanceError, match="5 stages requested but the model has only 3"):
        Pipeline(linear(n=3), ["cpu"] * 5)


@pytest.mark.parametrize("chunks", [0, -1, 2.5, True, "4"])
def test_chunks_must_be_a_positive_count(chunks: Any) -> None:
    with pytest.raises(ConfigError, match="is not a micro-batch count") as info:
        Pipeline(linear(), CPU1, chunks=chunks)
    assert isinstance(info.value, ValueError)


def test_checkpoint_mode_must_be_known() -> None:
    with pytest.raises(ConfigError, match="use one of never, except_last, always"):
        Pipeline(linear(), CPU1, chunks=2, checkpoint="INVALID")
    for mode in MODES:  # every mode is fine with one micro-batch
        assert Pipeline(linear(), CPU1, chunks=1, checkpoint=mode).checkpoint == mode


def test_an_empty_model_is_refused() -> None:
    # Deliberate: the peer runs an empty Sequential as the identity; a pipeline with no
    # layer places nothing, so torchgpu says so.
    with pytest.raises(BalanceError, match="the model has no layers"):
        Pipeline(nn.Sequential(), CPU1)


def test_layer_names_and_state_dict_keys_are_the_models() -> None:
    a, b = nn.Linear(1, 1), nn.Linear(1, 1)
    pipe = Pipeline(nn.Sequential(OrderedDict([("a", a), ("b", b)])), CPU2)
    assert pipe.layer_names == ("a", "b")
    names = {n for n, _ in pipe.named_modules()}
    assert {"module.a", "module.b"} <= names
    # Deliberate: the peer's keys are partitions.0.a.weight; torchgpu keeps the plain
    # model's keys so a checkpoint loads into the unsplit model.
    assert list(pipe.state_dict()) == ["a.weight", "a.bias", "b.weight", "b.bias"]
    with pytest.raises(AttributeError):
        pipe.a  # noqa: B018


@pytest.mark.parametrize(
    "move",
    [
        lambda m: m.cuda(),
        lambda m: m.cpu(),
        lambda m: m.to(torch.device("cuda")),
        lambda m: m.to(0),
        lambda m: m.to("cuda"),
        lambda m: m.to(device=0),
        lambda m: m.to(torch.rand(1)),
        lambda m: m.to(tensor=torch.rand(1)),
        lambda m: m.to("cpu", torch.double),
    ],
)
def test_moving_is_refused(move: Any) -> None:
    pipe = Pipeline(linear(n=2), CPU2)
    with pytest.raises(PlacementError, match="places its stages itself") as info:
        move(pipe)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ConfigError)


def test_casting_is_allowed() -> None:
    pipe = Pipeline(linear(n=2), CPU2)
    pipe.half()
    assert all(p.dtype == torch.half for p in pipe.parameters())
    pipe.to(torch.double)
    assert all(p.dtype == torch.double for p in pipe.parameters())
    pipe.to(dtype=torch.float)
    assert pipe(torch.rand(3, 1)).dtype == torch.float


def test_one_module_at_two_positions_on_one_device_trains_tied() -> None:
    # The peer refuses repeated children; torchgpu runs them, tied, when one device holds
    # every position (and refuses a split across devices; see the fault tests).
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 3, 1)
    ref = nn.Sequential(conv, nn.Tanh(), conv)
    for mode in MODES:
        assert_transparent(ref, Pipeline(copy.deepcopy(ref), CPU2, balance=[2, 1], chunks=2,
                                         checkpoint=mode), torch.randn(4, 3, 2, 2))
        ref.zero_grad()


def test_one_parameter_in_two_layers_on_one_device_trains_tied() -> None:
    class Wrap(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sin(self.inner(x))

    torch.manual_seed(0)
    conv = nn.Conv2d(3, 3, 1)
    ref = nn.Sequential(Wrap(conv), Wrap(conv))
    assert_transparent(ref, Pipeline(copy.deepcopy(ref), CPU2, chunks=3),
                       torch.randn(5, 3, 2, 2))


# ======================================================================= forward
@pytest.mark.parametrize("rows", [7, 2])
def test_uneven_and_small_batches_run_without_warnings(rows: int) -> None:
    ref = linear()
    pipe = Pipeline(copy.deepcopy(ref), CPU1, chunks=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_transparent(ref, pipe, torch.rand(rows, 1))


@pytest.mark.parametrize(("mode", "recomputed"), [("always", 2), ("except_last", 1),
                                                  ("never", 0)])
def test_checkpoint_mode_sets_how_many_micro_batches_recompute(mode: str, recomputed: int
                                                               ) -> None:
    counter = Counter()
    pipe = Pipeline(nn.Sequential(counter, nn.Linear(1, 1)), CPU1, chunks=2, checkpoint=mode)
    out = pipe(torch.rand(2, 1))
    assert counter.calls == 2
    out.sum().backward()
    assert counter.calls == 2 + recomputed


def test_no_checkpoint_in_eval_mode() -> None:
    counter = Counter()
    pipe = Pipeline(nn.Sequential(counter, nn.Linear(1, 1)), CPU1, chunks=2,
                    checkpoint="always")
    pipe.train()
    pipe(torch.rand(2, 1)).sum().backward()
    assert counter.calls == 4
    pipe.eval()
    pipe(torch.rand(2, 1)).sum().backward()
    assert counter.calls == 6


def test_no_grad_builds_no_graph() -> None:
    counter = Counter()
    pipe = Pipeline(nn.Sequential(counter, nn.Linear(1, 1)), CPU1, chunks=2,
                    checkpoint="always")
    seen: list[torch.Tensor] = []
    pipe.partitions[0].register_forward_hook(lambda m, i, o: seen.append(o))
    with torch.no_grad():
        out = pipe(torch.rand(2, 1))
    assert out.grad_fn is None and len(seen) == 2 and all(o.grad_fn is None for o in seen)


@pytest.mark.parametrize("chunks", [1, 3])
def test_an_exception_in_a_layer_reaches_the_caller(chunks: int) -> None:
    with pytest.raises(Expected):
        Pipeline(nn.Sequential(Raise()), CPU1, chunks=chunks)(torch.rand(3, 1))
    pipe = Pipeline(nn.Sequential(nn.Identity(), nn.Identity(), Raise()), ["cpu"] * 3,
                    chunks=chunks)
    with pytest.raises(Expected):  # and nothing waits forever on the failed stage
        pipe(torch.rand(3, 1))


def test_a_failing_stage_stops_the_pipeline_at_once() -> None:
    counter = Counter()
    model = nn.Sequential(nn.Identity(), nn.Identity(), counter, Raise())
    pipe = Pipeline(model, ["cpu"] * 4, chunks=3)
    with pytest.raises(Expected):
        pipe(torch.rand(3, 1))
    # clock 3 runs (2, 1), (1, 2), (0, 3): the counter saw micro-batches 0 and 1 only.
    assert counter.calls == 2


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc_a, self.fc_b = nn.Linear(1, 1), nn.Linear(1, 1)

    def forward(self, ab: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        a, b = ab
        return self.fc_a(a), self.fc_b(b)


class One(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(1, 1)

    def forward(self, only: tuple[torch.Tensor]) -> tuple[torch.Tensor]:
        (a,) = only
        return (self.fc(a),)


@pytest.mark.parametrize("mode", MODES)
def test_tuple_inputs_and_outputs(mode: str) -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(Two())
    pipe = Pipeline(copy.deepcopy(ref), CPU1, chunks=2, checkpoint=mode)
    a, b = torch.rand(10, 1), torch.rand(10, 1)
    ins = [(a.clone().requires_grad_(), b.clone().requires_grad_()) for _ in range(2)]
    out_ref, out = ref(ins[0]), pipe(ins[1])
    assert isinstance(out, tuple) and len(out) == 2
    (out_ref[0] + 2 * out_ref[1]).mean().backward()
    (out[0] + 2 * out[1]).mean().backward()
    for i in range(2):
        torch.testing.assert_close(out[i], out_ref[i])
        torch.testing.assert_close(ins[1][i].grad, ins[0][i].grad)
    assert grads(pipe).keys() == grads(ref).keys()

    single = Pipeline(nn.Sequential(One()), CPU1, chunks=2, checkpoint=mode)
    x = torch.rand(10, 1, requires_grad=True)
    (y,) = single((x,))
    y.mean().backward()
    assert x.grad is not None and all(p.grad is not None for p in single.parameters())


def test_extra_positional_arguments_are_a_type_error() -> None:
    pipe = Pipeline(linear(), CPU1)
    with pytest.raises(TypeError):
        pipe(torch.rand(1, 1), torch.rand(1, 1))  # type: ignore[call-arg]


class Hello(nn.Module):
    def forward(self, x: Any) -> Any:
        return "hello"


class WithTag(nn.Module):
    def forward(self, x: Any) -> Any:
        return x, "hello"


def test_non_tensor_values() -> None:
    with pytest.raises(MicroBatchTypeError, match=r"returned a str \('hello'\)") as info:
        Pipeline(nn.Sequential(Hello()), CPU1)(torch.rand(1, 1))
    assert isinstance(info.value, TypeError)
    with pytest.raises(TypeError, match="got str"):
        Pipeline(nn.Sequential(nn.Identity()), CPU1)("hello")
    # Deliberate: the peer refuses any non-tensor in a tuple; torchgpu hands a value that
    # every micro-batch shares through unchanged, as the plain model would return it.
    x = torch.rand(4, 1)
    out = Pipeline(nn.Sequential(WithTag()), CPU1, chunks=2, checkpoint="always")(x)
    assert torch.equal(out[0], x) and out[1] == "hello"
    back = Pipeline(nn.Sequential(nn.Identity()), CPU1, chunks=2)((x, "hello"))
    assert torch.equal(back[0], x) and back[1] == "hello"


def test_a_zero_dimensional_input_is_refused_for_every_chunk_count() -> None:
    # Deliberate: the peer lets chunks=1 take a scalar; torchgpu needs a batch dimension
    # for every M, so a model does not start failing when chunks is raised.
    for chunks in (1, 2):
        with pytest.raises(MicroBatchTypeError, match="0-dimensional"):
            Pipeline(nn.Sequential(nn.Identity()), CPU1, chunks=chunks)(torch.tensor(42.0))


class Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class PyIdentity(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Identity.apply(x)


def test_python_autograd_function_returning_its_input() -> None:
    pipe = Pipeline(nn.Sequential(PyIdentity(), PyIdentity()), CPU2, chunks=2,
                    checkpoint="always")
    x = torch.rand(4, 3)
    assert torch.equal(pipe(x), x)
    x.requires_grad_()
    pipe(x).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


class Dropouts(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(100):
            x = F.dropout(x, p=0.001)
        return x


def test_dropout_masks_replay_in_recomputation() -> None:
    # every element dropped in the forward must get zero gradient after recomputation
    pipe = Pipeline(nn.Sequential(Dropouts(), Dropouts()), CPU2, chunks=10, checkpoint="always")
    x = torch.rand(10, 10, requires_grad=True)
    y = pipe(x)
    y.norm().backward()
    assert y.to(torch.bool).tolist() == x.grad.to(torch.bool).tolist()


@pytest.mark.parametrize("chunks", [1, 3])
def test_dropout_with_checkpointing_gives_the_same_training_step(chunks: int) -> None:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.3),
                         nn.Linear(8, 2))
    x = torch.randn(9, 6)
    results = []
    for mode in MODES:
        pipe = Pipeline(copy.deepcopy(base), CPU2, chunks=chunks, checkpoint=mode)
        torch.manual_seed(1)
        out = pipe(x)
        out.pow(2).sum().backward()
        results.append((out.detach(), grads(pipe)))
    for out, g in results[1:]:
        torch.testing.assert_close(out, results[0][0], rtol=0, atol=0)
        for name, value in g.items():
            torch.testing.assert_close(value, results[0][1][name], msg=name)


@pytest.mark.parametrize("chunks", [1, 2, 4, 8])
@pytest.mark.parametrize("mode", MODES)
def test_linears_give_the_plain_models_gradients(chunks: int, mode: str) -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(1, 2), nn.Linear(2, 4), nn.Linear(4, 2), nn.Linear(2, 1))
    pipe = Pipeline(copy.deepcopy(ref), CPU2, balance=[2, 2], chunks=chunks, checkpoint=mode)
    assert_transparent(ref, pipe, torch.rand(8, 1))


# ======================================================================= in-place layers
def test_in_place_layer_after_a_stage_boundary() -> None:
    # Deliberate: the peer's stage input is a fresh leaf, so an in-place first layer
    # fails in backward; torchgpu passes the graph on and gives the plain gradients.
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(1, 1), nn.ReLU(inplace=True))
    for chunks in (1, 3):
        pipe = Pipeline(copy.deepcopy(ref), CPU2, chunks=chunks, checkpoint="always")
        assert_transparent(ref, pipe, torch.randn(3, 1), input_grad=False)
        ref.zero_grad()


def test_in_place_layer_on_an_input_without_grad() -> None:
    pipe = Pipeline(nn.Sequential(nn.ReLU(inplace=True)), CPU1, checkpoint="always")
    x = torch.randn(4, 1)
    out = pipe(x.clone())
    assert torch.equal(out, x.relu()) and not out.requires_grad


class BumpSecond(nn.Module):
    """Adds 1 in place to the second input (not requiring grad): not idempotent."""

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        foo, bar = pair
        bar.add_(1)
        return foo * bar


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_in_place_change_of_an_input_is_not_replayed(chunks: int, mode: str) -> None:
    # The peer recomputes on the modified input and gets 3; the plain model gives 2.
    pipe = Pipeline(nn.Sequential(BumpSecond()), CPU1, chunks=chunks, checkpoint=mode)
    foo = torch.ones(2, requires_grad=True)
    pipe((foo, torch.ones(2))).sum().backward()
    assert foo.grad.tolist() == [2.0, 2.0]


# ======================================================================= micro-batches
def test_scatter_and_gather_tensors_and_tuples() -> None:
    a, b = scatter(torch.zeros(2, 1), 2)
    assert a.shape == b.shape == (1, 1)
    pa, pb = scatter((torch.zeros(2, 1), torch.zeros(2, 2)), 2)
    assert pa[0].shape == pb[0].shape == (1, 1) and pa[1].shape == pb[1].shape == (1, 2)
    assert gather([torch.zeros(1, 1), torch.zeros(1, 1)]).shape == (2, 1)
    ab = gather([(torch.zeros(1, 1), torch.zeros(2, 2)), (torch.zeros(1, 1), torch.zeros(2, 2))])
    assert isinstance(ab, tuple) and ab[0].shape == (2, 1) and ab[1].shape == (4, 2)


def test_what_a_batch_may_hold() -> None:
    assert batch_size(torch.zeros(3)) == 3
    assert batch_size((torch.zeros(4, 1), torch.zeros(4, 2))) == 4
    for bad in (42, "str"):
        with pytest.raises(MicroBatchTypeError):
            batch_size(bad)  # type: ignore[arg-type]
    with pytest.raises(MicroBatchTypeError, match="0-dimensional"):
        batch_size(torch.tensor(42))
    with pytest.raises(ConfigError, match=r"different batch sizes \[2, 3\]"):
        batch_size((torch.zeros(2), torch.zeros(3)))
    # Deliberate: the peer refuses non-tensors in a batch; torchgpu hands them to every
    # micro-batch (a flag, a mode string), as the plain model would receive them.
    parts = scatter((torch.zeros(4, 1), 2), 2)
    assert [p[1] for p in parts] == [2, 2]


class MeanRows(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(0, keepdim=True)


class SeqFirst(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], 5, 2).transpose(0, 1)  # (5, rows, 2)


class Tokens(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, 2)  # (rows * 5, 2): flattened tokens, batch-major


@pytest.mark.parametrize("chunks", [1, 2, 3])
@pytest.mark.parametrize("last", [MeanRows(), SeqFirst()])
def test_an_output_without_the_batch_along_dim0_is_refused(chunks: int, last: nn.Module
                                                          ) -> None:
    # Joined along dim 0 these would silently differ from the plain model's output.
    pipe = Pipeline(nn.Sequential(nn.Linear(10, 10), last), CPU2, chunks=chunks)
    with pytest.raises(MicroBatchTypeError, match="whose dim 0 is not the batch"):
        pipe(torch.randn(6, 10))


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_flattened_tokens_are_joined_in_order(chunks: int) -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(10, 10), Tokens())
    assert_transparent(ref, Pipeline(copy.deepcopy(ref), CPU2, chunks=chunks),
                       torch.randn(7, 10))


# ======================================================================= schedule
def test_clock_cycles_table() -> None:
    assert list(clock_cycles(1, 1)) == [[(0, 0)]]
    assert list(clock_cycles(1, 3)) == [[(0, 0)], [(0, 1)], [(0, 2)]]
    assert list(clock_cycles(3, 1)) == [[(0, 0)], [(1, 0)], [(2, 0)]]
    assert list(clock_cycles(3, 3)) == [
        [(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1), (0, 2)], [(2, 1), (1, 2)], [(2, 2)],
    ]
    assert list(clock_cycles(4, 2)) == [
        [(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(3, 0), (2, 1)], [(3, 1)],
    ]


def test_forward_runs_in_clock_order() -> None:
    timeline: list[tuple[int, int]] = []

    class Log(nn.Module):
        def __init__(self, stage: int) -> None:
            super().__init__()
            self.stage, self.seen = stage, 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            timeline.append((self.seen, self.stage))
            self.seen += 1
            return x

    Pipeline(nn.Sequential(Log(0), Log(1)), CPU2, chunks=3)(torch.rand(3, 1))
    assert timeline == [(0, 0), (1, 0), (0, 1), (2, 0), (1, 1), (2, 1)]


# ======================================================================= balance
def test_partition_solver() -> None:
    assert solve_partition([1, 2, 3, 4, 5, 6], 2) == [4, 2]
    assert solve_partition([0, 0], 2) == [1, 1]
    for costs, parts in (([42], 0), ([42], -1), ([], 1), ([42], 2)):
        with pytest.raises(BalanceError):
            solve_partition(costs, parts)


class Delay(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x


def test_balance_by_time() -> None:
    layers = [Delay(i / 100) for i in [1, 2, 3, 4, 5, 6]]
    assert balance_by_time(layers, 2, torch.rand(1), runs=1, warmup=0) == [4, 2]


def test_balance_by_time_feeds_each_layer_the_previous_output() -> None:
    model = nn.Sequential(nn.Conv2d(3, 2, 1), nn.Flatten(), nn.Linear(128, 10))
    balance = balance_by_time(list(model), 2, torch.rand(10, 3, 8, 8), runs=1)
    assert sum(balance) == 3 and len(balance) == 2


class Expand(nn.Module):
    """Makes ``times`` tensors requiring grad in forward (memory a layer holds)."""

    def __init__(self, times: int) -> None:
        super().__init__()
        self.times = times

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.times):
            x = x + torch.rand_like(x, requires_grad=True)
        return x


def test_balance_by_size_counts_what_layers_create() -> None:
    sample = torch.rand(10, 100, 100)
    up = [Expand(i) for i in [1, 2, 3, 4, 5, 6]]
    assert balance_by_size(up, 2, sample) == [4, 2]
    down = [Expand(i) for i in [6, 5, 4, 3, 2, 1]]
    assert balance_by_size(down, 2, sample) == [2, 4]


def test_balance_by_size_counts_parameters() -> None:
    up = [nn.Linear(i + 1, i + 2) for i in range(6)]
    assert balance_by_size(up, 2, torch.rand(7, 1), param_scale=100) == [4, 2]
    down = [nn.Linear(i + 2, i + 1) for i in reversed(range(6))]
    assert balance_by_size(down, 2, torch.rand(1, 7), param_scale=100) == [2, 4]


class Tradeoff(nn.Module):
    def __init__(self, param_size: int, latent_size: int) -> None:
        super().__init__()
        self.fc = nn.Linear(param_size, param_size)
        self.latent_size = latent_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.latent_size):
            x = x + torch.rand_like(x, requires_grad=True)
        return x


def test_balance_by_size_param_scale_trades_weights_for_activations() -> None:
    # Parameters grow along the model, created activations shrink: param_scale picks.
    layers = [Tradeoff(p, 7 - p) for p in range(1, 7)]
    sample = torch.rand(1, requires_grad=True)
    by_activations = balance_by_size(layers, 2, sample, param_scale=0)
    by_weights = balance_by_size(layers, 2, sample, param_scale=100)
    assert by_activations == [2, 4]
    assert by_weights[0] > by_weights[1]  # exact bytes on the CPU: [5, 1]


@pytest.mark.parametrize("how", ["time", "size"])
def test_profiling_leaves_the_model_alone(how: str) -> None:
    class AssertTraining(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            assert self.training  # profiling measures a training step
            return x

    model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3), AssertTraining())
    model(torch.rand(2, 3, 4, 4)).sum().backward()  # gradients already there
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grad_before = model[0].weight.grad.clone()
    sample = torch.rand(2, 3, 10, 10)
    if how == "time":
        balance_by_time(list(model), 1, sample, runs=1)
    else:
        balance_by_size(list(model), 1, sample)
    assert not any(m.training for m in model.modules())
    assert all(p.device.type == "cpu" for p in model.parameters())
    after = model.state_dict()
    assert before.keys() == after.keys()
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    # Deliberate: the peer refuses a model with gradients; torchgpu profiles copies, so
    # the model's gradients are simply left as they were.
    assert torch.equal(model[0].weight.grad, grad_before)


class Twin(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x.detach()


class Add(nn.Module):
    def forward(self, ab: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return ab[0] + ab[1]


def test_profiling_passes_tuples_between_layers() -> None:
    sample = torch.rand(1, requires_grad=True)
    assert balance_by_time([Twin(), Add()], 1, sample, runs=1) == [2]
    assert balance_by_size([Twin(), Add()], 1, sample) == [2]


# ======================================================================= deferred BatchNorm
def tilted(rows: int = 16, size: int = 8) -> torch.Tensor:
    """Channels with very different scales, rows with very different means."""
    x = torch.rand(rows, 3, size, size)
    x = x * torch.tensor([1.0, 10.0, 100.0]).view(1, 3, 1, 1)
    return x + (2.0 ** torch.arange(rows, dtype=torch.float)).view(rows, 1, 1, 1) / 2**rows


def chunked(model: nn.Module, x: torch.Tensor, chunks: int) -> torch.Tensor:
    return torch.cat([model(c) for c in x.chunk(chunks)])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunks", [2, 4])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_deferred_running_stats_are_the_full_batchs(mode: str, chunks: int,
                                                    momentum: float | None) -> None:
    bn = nn.BatchNorm2d(3, momentum=momentum)
    pipe = Pipeline(nn.Sequential(copy.deepcopy(bn)), CPU1, chunks=chunks, checkpoint=mode,
                    deferred_batch_norm=True)
    for _ in range(2):
        x = tilted()
        pipe(x).mean().backward()
        bn(x).mean().backward()
    got = pipe[0]
    assert isinstance(got, DeferredBatchNorm)
    torch.testing.assert_close(got.running_mean, bn.running_mean, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.running_var, bn.running_var, rtol=1e-4, atol=1e-3)
    assert got.num_batches_tracked.item() == 2


@pytest.mark.parametrize("mode", ["never", "always"])
def test_deferred_parameters_get_the_plain_gradients_with_one_chunk(mode: str) -> None:
    bn = nn.BatchNorm2d(3)
    pipe = Pipeline(nn.Sequential(copy.deepcopy(bn)), CPU1, chunks=1, checkpoint=mode,
                    deferred_batch_norm=True)
    x = torch.rand(4, 3, 10, 10)
    (pipe(x) * torch.arange(3.0).view(1, 3, 1, 1)).pow(2).mean().backward()
    (bn(x) * torch.arange(3.0).view(1, 3, 1, 1)).pow(2).mean().backward()
    torch.testing.assert_close(pipe[0].weight.grad, bn.weight.grad)
    torch.testing.assert_close(pipe[0].bias.grad, bn.bias.grad)


@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("input_grad", [True, False])
def test_deferred_layer_normalises_like_batch_norm_per_micro_batch(chunks: int,
                                                                   input_grad: bool) -> None:
    bn = nn.BatchNorm2d(3)
    dbn = DeferredBatchNorm.from_batch_norm(copy.deepcopy(bn))
    x = tilted()
    x1, x2 = x.clone().requires_grad_(input_grad), x.clone().requires_grad_(input_grad)
    out1, out2 = chunked(bn, x1, chunks), chunked(dbn, x2, chunks)
    torch.testing.assert_close(out2, out1, rtol=1e-4, atol=1e-4)
    out1.mean().backward()
    out2.mean().backward()
    torch.testing.assert_close(dbn.weight.grad, bn.weight.grad, rtol=1e-4, atol=1e-4)
    if input_grad:
        torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-4, atol=1e-4)


def test_conversion_keeps_what_it_need_not_change() -> None:
    plain = nn.Sequential(nn.BatchNorm2d(3, track_running_stats=False))
    convert_deferred_batch_norm(plain)
    assert type(plain[0]) is nn.BatchNorm2d  # no running statistics to defer
    dbn = DeferredBatchNorm(3)
    holder = nn.Sequential(dbn)
    assert convert_deferred_batch_norm(holder) == [dbn] and holder[0] is dbn
    bn = nn.BatchNorm2d(3)
    user = nn.Sequential(bn, nn.ReLU())
    Pipeline(user, CPU1, deferred_batch_norm=True)
    assert isinstance(user[0], DeferredBatchNorm) and user[0].running_mean is bn.running_mean


def test_deferred_eval_after_training_matches() -> None:
    bn = nn.BatchNorm2d(3)
    pipe = Pipeline(nn.Sequential(copy.deepcopy(bn)), CPU1, chunks=4, deferred_batch_norm=True)
    x = tilted()
    bn(x)
    pipe(x)
    bn.eval()
    pipe.eval()
    torch.testing.assert_close(pipe(x), bn(x), rtol=1e-4, atol=1e-4)


def test_deferred_optimised_steps_track_the_plain_layer() -> None:
    bn = nn.BatchNorm2d(3)
    pipe = Pipeline(nn.Sequential(copy.deepcopy(bn)), CPU1, chunks=4, deferred_batch_norm=True)
    opt = torch.optim.SGD([*bn.parameters(), *pipe.parameters()], lr=1.0)
    for _ in range(3):
        x = tilted()
        bn.train()
        pipe.train()
        bn(x).sum().backward()
        pipe(x).sum().backward()
        opt.step()
        opt.zero_grad()
        bn.eval()
        pipe.eval()
        with torch.no_grad():
            torch.testing.assert_close(pipe(x), bn(x), rtol=1e-3, atol=1e-3)


def test_deferred_after_a_conv_tracks_the_first_step_exactly() -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3))
    pipe = Pipeline(copy.deepcopy(ref), CPU2, chunks=4, deferred_batch_norm=True)
    opt = torch.optim.SGD([*ref.parameters(), *pipe.parameters()], lr=0.1)
    x = tilted()
    a, b = ref(x), pipe(x)
    assert not torch.allclose(a, b)  # normalised per micro-batch vs per batch
    a.sum().backward()
    b.sum().backward()
    opt.step()
    assert not torch.allclose(ref[0].weight, pipe[0].weight)
    torch.testing.assert_close(pipe[1].running_mean, ref[1].running_mean, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pipe[1].running_var, ref[1].running_var, rtol=1e-3, atol=1e-2)


def test_deferred_accumulators_hold_no_graph() -> None:
    pipe = Pipeline(nn.Sequential(nn.BatchNorm2d(3)), CPU1, chunks=4, deferred_batch_norm=True)
    dbn = pipe[0]
    assert isinstance(dbn, DeferredBatchNorm)
    dbn.tracking = True
    dbn(tilted().requires_grad_())
    dbn.tracking = False
    assert dbn._acc and all(not t.requires_grad for _, *ts in dbn._acc for t in ts)


# ----------------------------------------------------------------- running statistics
def bn_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))


@pytest.mark.parametrize(("mode", "chunks"), [("always", 1), ("always", 2), ("except_last", 3)])
def test_recomputation_does_not_update_running_stats_again(mode: str, chunks: int) -> None:
    # Plain BatchNorm in a pipeline updates once per micro-batch, as the plain model run
    # on each micro-batch; recomputing a checkpointed stage must not count it twice.
    ref = bn_model()
    pipe = Pipeline(copy.deepcopy(ref), CPU2, chunks=chunks, checkpoint=mode)
    x = torch.randn(12, 3)
    pipe(x).sum().backward()
    chunked(ref, x, chunks).sum().backward()
    bn, want = pipe.module[1], ref[1]
    assert bn.num_batches_tracked.item() == want.num_batches_tracked.item() == chunks
    torch.testing.assert_close(bn.running_mean, want.running_mean)
    torch.testing.assert_close(bn.running_var, want.running_var)
    assert_transparent_eval(ref, pipe, x)


def assert_transparent_eval(ref: nn.Module, pipe: nn.Module, x: torch.Tensor) -> None:
    ref.eval()
    pipe.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), ref(x))


def test_recomputation_leaves_instance_norm_statistics() -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv1d(2, 2, 1), nn.InstanceNorm1d(2, track_running_stats=True),
                        nn.Tanh())
    pipe = Pipeline(copy.deepcopy(ref), CPU1, chunks=1, checkpoint="always")
    x = torch.randn(4, 2, 5)
    pipe(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    torch.testing.assert_close(pipe.module[1].running_mean, ref[1].running_mean)
    torch.testing.assert_close(pipe.module[1].running_var, ref[1].running_var)


def reused_bn_model(seed: int = 0) -> tuple[nn.Sequential, nn.BatchNorm1d]:
    torch.manual_seed(seed)
    bn = nn.BatchNorm1d(4)
    return nn.Sequential(nn.Linear(4, 4), bn, nn.Linear(4, 4), bn, nn.Tanh()), bn


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("balance", [[4, 1], [2, 3]])
def test_deferred_layer_used_at_two_positions_updates_twice(mode: str, balance: list[int]
                                                            ) -> None:
    # The plain model updates a BatchNorm once per call: twice per batch here. With one
    # micro-batch the deferred layer normalises as the plain one, so all must be equal.
    ref, bn = reused_bn_model()
    pipe = Pipeline(copy.deepcopy(ref), CPU2, balance=balance, chunks=1, checkpoint=mode,
                    deferred_batch_norm=True)
    x = torch.randn(12, 4)
    torch.testing.assert_close(pipe(x), ref(x))
    got = pipe[1]
    assert got is pipe[3] and isinstance(got, DeferredBatchNorm)
    assert got.num_batches_tracked.item() == 2
    torch.testing.assert_close(got.running_mean, bn.running_mean)
    torch.testing.assert_close(got.running_var, bn.running_var)


@pytest.mark.parametrize("mode", MODES)
def test_deferred_layer_used_at_two_positions_pools_each_position(mode: str) -> None:
    # With micro-batches, each position's update must use that position's inputs over
    # the whole batch (recorded here while the pipeline's forward tracks).
    ref, _ = reused_bn_model()
    pipe = Pipeline(copy.deepcopy(ref), CPU2, balance=[2, 3], chunks=3, checkpoint=mode,
                    deferred_batch_norm=True)
    dbn = pipe[1]
    assert isinstance(dbn, DeferredBatchNorm)
    seen: dict[int, list[list[torch.Tensor]]] = {}

    def record(module: nn.Module, args: tuple[torch.Tensor], out: torch.Tensor) -> None:
        if dbn.tracking:
            calls = seen.setdefault(dbn.micro_batch, [])
            calls.append(args[0].detach().clone())

    dbn.register_forward_hook(record)
    pipe(torch.randn(12, 4)).sum().backward()
    assert sorted(seen) == [0, 1, 2] and all(len(c) == 2 for c in seen.values())
    want = nn.BatchNorm1d(4)
    for position in range(2):  # the plain layer fed each position's whole-batch input
        want.train()(torch.cat([seen[i][position] for i in range(3)]))
    assert dbn.num_batches_tracked.item() == 2
    torch.testing.assert_close(dbn.running_mean, want.running_mean)
    torch.testing.assert_close(dbn.running_var, want.running_var)


class Fails(nn.Module):
    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if Fails.armed:
            raise Expected()
        return x


def test_a_failed_forward_leaves_nothing_in_deferred_statistics() -> None:
    bn = nn.BatchNorm1d(2)
    pipe = Pipeline(nn.Sequential(copy.deepcopy(bn), Fails()), CPU2, chunks=2,
                    deferred_batch_norm=True)
    Fails.armed = True
    try:
        with pytest.raises(Expected):
            pipe(torch.randn(4, 2) * 10 + 5)
    finally:
        Fails.armed = False
    x = torch.randn(4, 2)
    pipe(x)
    bn(x)
    torch.testing.assert_close(pipe[0].running_mean, bn.running_mean)
    torch.testing.assert_close(pipe[0].running_var, bn.running_var)
    assert pipe[0].num_batches_tracked.item() == 1


# ======================================================================= inputs and stages
@pytest.mark.parametrize("mode", MODES)
def test_integer_inputs(mode: str) -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 2))
    pipe = Pipeline(copy.deepcopy(ref), CPU2, chunks=3, checkpoint=mode)
    assert_transparent(ref, pipe, torch.randint(0, 10, (5, 3)))


@pytest.mark.parametrize("mode", MODES)
def test_inputs_without_grad_still_train_the_weights(mode: str) -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    pipe = Pipeline(copy.deepcopy(ref), CPU2, chunks=2, checkpoint=mode)
    assert_transparent(ref, pipe, torch.randn(4, 3), input_grad=False)


def test_nothing_requiring_grad_gives_an_output_without_grad() -> None:
    # Deliberate: the peer's checkpoint makes such an output require grad; torchgpu's
    # output requires grad exactly when the plain model's does.
    class Double(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    for mode in MODES:
        out = Pipeline(nn.Sequential(Double()), CPU1, chunks=2, checkpoint=mode)(torch.ones(2))
        assert not out.requires_grad and out.tolist() == [2.0, 2.0]


@pytest.mark.parametrize("chunks", [1, 3])
def test_an_empty_batch(chunks: int) -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    pipe = Pipeline(copy.deepcopy(ref), CPU2, chunks=chunks, checkpoint="always")
    x = torch.randn(0, 3, requires_grad=True)
    out = pipe(x)
    assert out.shape == (0, 2)
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == (0, 3)


@pytest.mark.parametrize("mode", MODES)
def test_more_chunks_than_rows_and_a_stage_without_parameters(mode: str) -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Tanh(), nn.Linear(4, 2))
    pipe = Pipeline(copy.deepcopy(ref), ["cpu"] * 3, balance=[1, 2, 1], chunks=8,
                    checkpoint=mode)
    assert list(pipe.partitions[1].parameters()) == []
    assert_transparent(ref, pipe, torch.randn(3, 3))


class Nest(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.fc(x)
        return (h, (h.sin(), {"c": h.cos(), "tag": "n"}), [h * 2])


class Unnest(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, t: Any) -> torch.Tensor:
        h, (s, d), (twice,) = t
        assert d["tag"] == "n"
        return self.fc(h + s * d["c"] + twice)


@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("mode", MODES)
def test_nested_structures_between_stages(chunks: int, mode: str) -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(Nest(), Unnest())
    pipe = Pipeline(copy.deepcopy(ref), CPU2, chunks=chunks, checkpoint=mode)
    assert_transparent(ref, pipe, torch.randn(5, 3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_tensor_of_a_tuple_waits_for_its_stream() -> None:
    class Fan(nn.Module):
        def forward(self, ab: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
            a, b = ab
            return a * 1, b * 2, b * 3

    class Merge(nn.Module):
        def forward(self, abc: tuple[torch.Tensor, ...]) -> torch.Tensor:
            return abc[0] + abc[1] + abc[2]

    devices = ["cuda:0", "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"]
    pipe = Pipeline(nn.Sequential(Fan(), Merge()), devices, chunks=32, checkpoint="never")
    a = torch.rand(1024, 3, 32, 32, device="cuda:0", requires_grad=True)
    b = torch.rand(1024, 3, 32, 32, device="cuda:0", requires_grad=True)
    pipe((a, b)).norm().backward()
    torch.cuda.synchronize()
    assert torch.isclose(b.grad.norm().cpu(), torch.tensor(5.0))


# ======================================================================= aliasing
class Fan(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x * 1
        return h, h  # one tensor at two places


class DoubleFirst(nn.Module):
    def forward(self, ab: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        a, b = ab
        a.mul_(2)  # b is a, so b doubles too
        return a + b


@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("mode", MODES)
def test_a_tensor_held_twice_stays_one_tensor(chunks: int, mode: str) -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(2, 2), Fan(), DoubleFirst())
    pipe = Pipeline(copy.deepcopy(ref), CPU2, balance=[2, 1], chunks=chunks, checkpoint=mode)
    assert_transparent(ref, pipe, torch.randn(6, 2))
    x = torch.randn(6, 2)
    plain = nn.Sequential(DoubleFirst())(tuple([x.clone()] * 2))
    y = x.clone()
    torch.testing.assert_close(Pipeline(nn.Sequential(DoubleFirst()), CPU1, chunks=chunks,
                                        checkpoint=mode)((y, y)), plain)


def test_choosing_chunks_leaves_the_random_state() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2))
    sample, target = torch.randn(4, 4), torch.randn(4, 2)
    state = torch.get_rng_state()
    Pipeline(model, CPU2, chunks="auto", sample=sample, sample_target=target,
             loss_fn=F.mse_loss)
    assert torch.equal(torch.get_rng_state(), state)
