"""Pipeline and model-split fault cases: a layer object used at several positions,
stages that return non-tensors, in-place layers at a checkpointed stage's start,
checkpointing in eval mode, and balance profiling (mode, random state, created
tensors)."""

from __future__ import annotations

import copy
import time
from collections import namedtuple
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from torchgpu.errors import ConfigError, MicroBatchTypeError
from torchgpu.parallel.balance import balance_by_size, balance_by_time, layer_sizes, layer_times
from torchgpu.parallel.microbatch import gather, scatter
from torchgpu.parallel.model import check_shared_state, named_layers, split_model
from torchgpu.parallel.pipeline import Pipeline
from torchgpu.parallel.stages import StagePipeline

CPU2 = ["cpu", "cpu"]


def assert_same_training(ref: nn.Module, model: nn.Module, x: torch.Tensor) -> None:
    """``model`` (split or pipelined) gives ``ref``'s outputs, input and weight gradients."""
    y = torch.randn(x.shape[0], 3)
    x_ref, x_new = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref, out = ref(x_ref), model(x_new)
    torch.testing.assert_close(out, out_ref)
    nn.functional.mse_loss(out_ref, y).backward()
    nn.functional.mse_loss(out, y).backward()
    torch.testing.assert_close(x_new.grad, x_ref.grad)
    got = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        q = got[f"module.{name}"]
        assert q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, msg=name)


# ------------------------------------------------------------ a layer used twice
def reused_act(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    act = nn.Tanh()
    return nn.Sequential(nn.Linear(4, 6), act, nn.Linear(6, 3), act)


@pytest.mark.parametrize("balance", [None, [3, 1], [1, 3]])
def test_reused_stateless_layer_keeps_every_position_in_split_model(balance: Any) -> None:
    ref = reused_act()
    split = split_model(copy.deepcopy(ref), CPU2, balance=balance)
    assert sum(split.balance) == 4 and split.layer_names == ("0", "1", "2", "3")
    assert_same_training(ref, split, torch.randn(5, 4))


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("chunks", [1, 3])
def test_reused_stateless_layer_keeps_every_position_in_pipeline(
    chunks: int, checkpoint: str
) -> None:
    ref = reused_act()
    pipe = Pipeline(copy.deepcopy(ref), CPU2, balance=[3, 1], chunks=chunks,
                    checkpoint=checkpoint)
    assert pipe.balance == (3, 1)
    assert_same_training(ref, pipe, torch.randn(7, 4))


def test_reused_layer_with_weights_on_one_device_runs_tied() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(3, 3)
    ref = nn.Sequential(lin, nn.ReLU(), lin)
    pipe = Pipeline(copy.deepcopy(ref), CPU2, balance=[2, 1], chunks=2)
    assert_same_training(ref, pipe, torch.randn(6, 3))


def test_reused_or_tied_weights_across_devices_are_refused() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(3, 3)
    # "meta" stands in for a second device: the check runs before anything moves.
    with pytest.raises(ConfigError, match=r"same Linear object is used at layers '0' and '2'"
                       r".*copy\.deepcopy"):
        split_model(nn.Sequential(lin, nn.ReLU(), lin), ["cpu", "meta"], balance=[2, 1])
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    b.weight = a.weight
    with pytest.raises(ConfigError, match=r"share the tensor 'weight'.*one device only"):
        Pipeline(nn.Sequential(a, nn.ReLU(), b), ["cpu", "meta"], balance=[1, 2])
    # a stateless module may sit on both devices
    check_shared_state(["0", "1", "2"], [nn.ReLU()] * 3, ["cpu", "meta", "cuda:0"])


def test_stage_pipeline_refuses_weights_shared_by_two_ranks() -> None:
    lin = nn.Linear(3, 3)
    with pytest.raises(ConfigError, match=r"rank 0 and rank 1"):
        StagePipeline(nn.Sequential(lin, nn.ReLU(), lin, nn.ReLU()), device="cpu",
                      loss_fn=nn.functional.mse_loss, rank=0, world_size=2)
    act = nn.ReLU()
    pipe = StagePipeline(nn.Sequential(nn.Linear(3, 3), act, nn.Linear(3, 3), act),
                         device="cpu", loss_fn=nn.functional.mse_loss, rank=1, world_size=2)
    assert pipe.balance == (2, 2) and len(pipe.modules[0]) == 2


def test_sequential_view_with_a_repeated_block_lists_every_position() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
            self.head = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.block(self.block(x)))

        def as_sequential(self) -> nn.Sequential:
            return nn.Sequential(self.block, self.block, self.head)

    _, named = named_layers(Net())
    assert [n for n, _ in named] == ["0", "1", "2"]
    torch.manual_seed(0)
    ref = Net()
    assert_same_training(ref, split_model(copy.deepcopy(ref), CPU2), torch.randn(4, 4))


# ------------------------------------------------------------ non-tensor stage outputs
class Returns(nn.Module):
    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value

    def forward(self, x: torch.Tensor) -> Any:
        return self.value


class Sum(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum()


class Rows(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return x, int(x.shape[0])


@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize(
    ("last", "match"),
    [
        (Returns("hello"), r"last layer '1' \(Returns\) returned a str \('hello'\)"),
        (Returns(None), r"last layer '1' \(Returns\) returned None.*forget a return"),
        (Returns(object()), r"returned a object .*holds no tensor"),
        (Sum(), r"last layer '1' \(Sum\) returned a 0-dimensional tensor at the output"),
    ],
)
def test_outputs_the_pipeline_cannot_join_are_refused(chunks: int, last: nn.Module,
                                                      match: str) -> None:
    pipe = Pipeline(nn.Sequential(nn.Linear(4, 3), last), CPU2, chunks=chunks)
    with pytest.raises(MicroBatchTypeError, match=match) as info:
        pipe(torch.randn(6, 4))
    assert isinstance(info.value, TypeError) and isinstance(info.value, ConfigError)


@pytest.mark.parametrize("rows", [7, 8])
def test_a_number_in_the_output_is_refused(rows: int) -> None:
    # 7 rows: micro-batches of 2, 2, 2, 1 disagree. 8 rows: all say 2 while the plain
    # model says 8, so agreement between micro-batches does not make a number right.
    pipe = Pipeline(nn.Sequential(nn.Linear(4, 3), Rows()), CPU2, chunks=4)
    with pytest.raises(MicroBatchTypeError, match=r"returned a int \(2\) at the output\[1\]"):
        pipe(torch.randn(rows, 4))


Pair = namedtuple("Pair", ["a", "b"])


class ToDict(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        return {"h": x, "pair": Pair(x * 2, "tag"), "none": None}


class FromDict(nn.Module):
    def forward(self, d: dict[str, Any]) -> Any:
        assert d["none"] is None and d["pair"].b == "tag"
        return {"logits": d["h"] + d["pair"].a, "kind": "dict"}


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("chunks", [1, 3])
def test_dicts_and_named_tuples_between_and_after_stages(chunks: int, checkpoint: str) -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 3), ToDict(), FromDict())
    pipe = Pipeline(copy.deepcopy(ref), ["cpu", "cpu", "cpu"], chunks=chunks,
                    checkpoint=checkpoint)
    x = torch.randn(7, 4)
    out, want = pipe(x), ref(x)
    assert out["kind"] == "dict"
    torch.testing.assert_close(out["logits"], want["logits"])
    out["logits"].sum().backward()
    want["logits"].sum().backward()
    torch.testing.assert_close(pipe.module[0].weight.grad, ref[0].weight.grad)


class Split2(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x[:, :2], x[:, 2:]


class Join2(nn.Module):
    def forward(self, xy: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.cat([xy[1], xy[0]], dim=1)


def test_tuples_of_tensors_between_stages_and_dict_inputs() -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 3), Split2(), Join2(), nn.Linear(3, 3))
    assert_same_training(ref, Pipeline(copy.deepcopy(ref), ["cpu"] * 3, chunks=3),
                         torch.randn(5, 4))
    batch = {"x": torch.arange(10.0).reshape(5, 2), "flag": True}
    parts = scatter(batch, 2)
    assert [p["x"].shape[0] for p in parts] == [3, 2] and all(p["flag"] for p in parts)
    back = gather(parts)
    assert torch.equal(back["x"], batch["x"]) and back["flag"] is True


# ------------------------------------------------------------ in-place at a stage start
class Double(nn.Module):
    """Doubles its input in place: not idempotent, so a recomputation that saw the
    modified input would give different gradients."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2)


def inplace_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(4, 6), nn.ReLU(inplace=True), nn.Linear(6, 6), Double(), nn.Linear(6, 3)
    )


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("balance", [[1, 4], [3, 2], [1, 2, 2]])
@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_in_place_layer_at_a_stage_start(chunks: int, balance: list[int],
                                         checkpoint: str) -> None:
    ref = inplace_model()
    pipe = Pipeline(copy.deepcopy(ref), ["cpu"] * len(balance), balance=balance,
                    chunks=chunks, checkpoint=checkpoint)
    assert_same_training(ref, pipe, torch.randn(8, 4))


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_in_place_first_layer_on_the_pipeline_input(checkpoint: str) -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(Double(), nn.Linear(4, 3), nn.Tanh())
    pipe = Pipeline(copy.deepcopy(ref), CPU2, chunks=3, checkpoint=checkpoint)
    w = torch.randn(6, 4, requires_grad=True)  # the input is itself computed: not a leaf
    w2 = w.detach().clone().requires_grad_()
    want = ref(w * 1.5)
    out = pipe(w2 * 1.5)
    torch.testing.assert_close(out, want)
    want.sum().backward()
    out.sum().backward()
    torch.testing.assert_close(w2.grad, w.grad)
    torch.testing.assert_close(pipe.module[1].weight.grad, ref[1].weight.grad)


# ------------------------------------------------------------ checkpointing and the mode
class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x


@pytest.mark.parametrize("checkpoint", ["except_last", "always"])
def test_no_recomputation_in_eval_mode(checkpoint: str) -> None:
    counter = Counter()
    model = nn.Sequential(counter, nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    pipe = Pipeline(model, CPU2, balance=[2, 2], chunks=4, checkpoint=checkpoint)
    pipe.eval()
    pipe(torch.randn(8, 4)).sum().backward()  # gradients on, eval mode
    assert counter.calls == 4
    pipe.train()
    pipe(torch.randn(8, 4)).sum().backward()
    assert counter.calls == 4 + 4 + (3 if checkpoint == "except_last" else 4)


# ------------------------------------------------------------ balance profiling
class ModeProbe(nn.Module):
    """Records the mode it runs in (class-wide: profiling runs copies), sleeps in training."""

    modes: ClassVar[list[bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ModeProbe.modes.append(self.training)
        if self.training:
            time.sleep(0.01)
        return x * 1.0


def test_balance_profiles_training_and_leaves_the_model_alone() -> None:
    model = nn.Sequential(ModeProbe(), nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 4))
    model.eval()
    ModeProbe.modes = []
    sample = torch.randn(8, 4)
    assert balance_by_time(list(model), 2, sample, runs=2) == [1, 3]
    balance_by_size(list(model), 2, sample)
    assert ModeProbe.modes and all(ModeProbe.modes)
    assert not any(m.training for m in model.modules())
    model.train()
    torch.manual_seed(0)
    rng = torch.get_rng_state()
    layer_times(list(model), sample, runs=1)
    layer_sizes(list(model), sample)
    assert torch.equal(torch.get_rng_state(), rng)  # Dropout's draws were put back
    assert all(m.training for m in model.modules())


def test_balance_profiles_under_no_grad_and_in_place_layers() -> None:
    sample = torch.randn(8, 4)
    before = sample.clone()
    layers = [nn.ReLU(inplace=True), nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4)]
    with torch.no_grad():
        sizes = layer_sizes(layers, sample)
        assert len(layer_times(layers, sample, runs=1)) == 4
    assert torch.equal(sample, before)  # the caller's sample is never written
    assert sizes[2] >= 8 * 4 * 4  # the in-place ReLU saves its output for backward


class MakesWeight(nn.Module):
    """Builds a tensor requiring grad in forward that no op saves (sum saves nothing)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.zeros(4096, requires_grad=True)
        return x + w.sum()


def test_balance_by_size_counts_tensors_a_layer_creates() -> None:
    layers = [nn.Linear(4, 4), MakesWeight(), nn.Linear(4, 4), nn.Linear(4, 4)]
    sizes = layer_sizes(layers, torch.randn(8, 4))
    assert sizes[1] >= 2 * 4096 * 4  # the values and their gradient
    assert sizes[1] > 10 * max(sizes[0], sizes[2], sizes[3])
    # a parameter shared by two positions is stored once: counted at its first
    lin = nn.Linear(64, 64)
    shared = layer_sizes([lin, nn.ReLU(), lin])
    assert shared[0] == 2 * (64 * 64 + 64) * 4 and shared[2] == 0


def test_mapping_types_survive_scatter_and_gather() -> None:
    from collections import OrderedDict, UserDict

    for kind in (OrderedDict, UserDict):
        batch = kind(x=torch.arange(12.0).reshape(6, 2))
        parts = scatter(batch, 4)
        assert all(type(p) is kind for p in parts)
        back = gather(parts)
        assert type(back) is kind and torch.equal(back["x"], batch["x"])


def test_chunks_auto_with_a_dict_sample() -> None:
    class Pick(nn.Module):
        def forward(self, d: dict[str, torch.Tensor]) -> torch.Tensor:
            return d["x"]

    pipe = Pipeline(nn.Sequential(Pick(), nn.Linear(3, 2), nn.Linear(2, 2)), CPU2,
                    chunks="auto", sample={"x": torch.randn(4, 3)},
                    sample_target=torch.randn(4, 2), loss_fn=nn.functional.mse_loss)
    assert [r.chunks for r in pipe.chunk_choice.table] == [1, 2, 3, 4]
