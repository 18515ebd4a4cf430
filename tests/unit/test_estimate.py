"""estimate_memory: exact state arithmetic (tables), activations vs real saved bytes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from torchgpu.errors import BalanceError, ConfigError
from torchgpu.memory.activation_checkpointing import (
    apply_activation_checkpointing,
    segment_bounds,
    sqrt_segments,
)
from torchgpu.memory.estimate import estimate_memory, measure_activations
from torchgpu.memory.estimate.activations import ActivationProfile
from torchgpu.memory.estimate.arithmetic import (
    checkpointed_bytes,
    optimizer_kind,
    retained_bytes,
    round_up,
    state_bytes,
    training_peak_bytes,
)
from torchgpu.memory.saved_tensors import saved_tensor_bytes
from torchgpu.models import HousingNet, LeNet5, resnet50

# ---------------------------------------------------------------- pure arithmetic


@pytest.mark.parametrize(
    ("optimizer", "kind"),
    [
        ("adam", "adam"),
        ("AdamW", "adamw"),
        ("sgd-momentum", "sgd_momentum"),
        (torch.optim.Adagrad, "adagrad"),
        (lambda p: torch.optim.SGD(p, lr=0.1), "sgd"),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "sgd_momentum"),
        (lambda p: torch.optim.Adam(p, amsgrad=True), "adam_amsgrad"),
        (lambda p: torch.optim.RMSprop(p, centered=True), "rmsprop_centered"),
        (lambda p: torch.optim.RMSprop(p, momentum=0.5), "rmsprop_momentum"),
    ],
)
def test_optimizer_kind(optimizer: object, kind: str) -> None:
    if callable(optimizer) and not isinstance(optimizer, type):
        optimizer = optimizer([nn.Parameter(torch.zeros(2))])
    assert optimizer_kind(optimizer) == kind  # type: ignore[arg-type]


def test_unknown_optimizer() -> None:
    with pytest.raises(ConfigError, match=r"'lamb'.*adam"):
        optimizer_kind("lamb")


@pytest.mark.parametrize(
    ("nbytes", "block", "expected"),
    [(0, 512, 0), (1, 512, 512), (512, 512, 512), (513, 512, 1024), (7, 1, 7)],
)
def test_round_up(nbytes: int, block: int, expected: int) -> None:
    assert round_up(nbytes, block) == expected


TENSORS = [(1000, 4, True), (10, 4, True), (5, 4, False)]  # weight, bias, a buffer


@pytest.mark.parametrize(
    ("optimizer", "block", "shards", "expected"),
    [
        # params, grads, optimizer, step workspace
        ("adam", 1, 1, (4060, 4040, 8080, 4040)),
        ("sgd", 1, 1, (4060, 4040, 0, 0)),
        ("sgd_momentum", 1, 1, (4060, 4040, 4040, 0)),
        ("adam_amsgrad", 1, 1, (4060, 4040, 12120, 4040)),
        ("adam", 512, 1, (5120, 4608, 9216, 4608)),
        ("adam", 1, 4, (1020, 1012, 2024, 1012)),  # ceil(1000/4), ceil(10/4), ceil(5/4)
    ],
)
def test_state_bytes_table(
    optimizer: str, block: int, shards: int, expected: tuple[int, int, int, int]
) -> None:
    s = state_bytes(TENSORS, optimizer, block, shards)
    got = (s.parameters_bytes, s.gradients_bytes, s.optimizer_bytes, s.step_workspace_bytes)
    assert got == expected


def test_state_bytes_half_precision_parameters() -> None:
    s = state_bytes([(100, 2, True)], "adam", block_bytes=1)
    assert (s.parameters_bytes, s.gradients_bytes, s.optimizer_bytes) == (200, 200, 400)


@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (lambda p: torch.optim.Adam(p, lr=1e-3), "adam"),
        (lambda p: torch.optim.AdamW(p, lr=1e-3), "adamw"),
        (lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9), "sgd_momentum"),
        (lambda p: torch.optim.SGD(p, lr=1e-3), "sgd"),
        (lambda p: torch.optim.RMSprop(p, lr=1e-3), "rmsprop"),
        (lambda p: torch.optim.Adam(p, lr=1e-3, amsgrad=True), "adam_amsgrad"),
    ],
)
def test_optimizer_bytes_equal_a_real_optimizers_state(make, kind: str) -> None:  # type: ignore[no-untyped-def]
    model = LeNet5()
    opt = make(model.parameters())
    model(torch.randn(2, 1, 28, 28)).sum().backward()
    opt.step()
    real = sum(
        t.nbytes
        for state in opt.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0  # 'step' is a CPU scalar
    )
    params = [(p.numel(), p.element_size(), True) for p in model.parameters()]
    assert optimizer_kind(opt) == kind
    assert state_bytes(params, kind, block_bytes=1).optimizer_bytes == real
    grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    assert state_bytes(params, kind, block_bytes=1).gradients_bytes == grads


# Three layers; storage keys 1..6 with sizes. Layer 0 saves {1, 2}, layer 1 {2, 3},
# layer 2 {4}; inputs: layer 0 <- 1, layer 1 <- 2, layer 2 <- 5.
SIZES = {1: 100, 2: 40, 3: 30, 4: 7, 5: 20, 6: 1}
SAVED = (frozenset({1, 2}), frozenset({2, 3}), frozenset({4}))
INPUTS = (frozenset({1}), frozenset({2}), frozenset({5}))


@pytest.mark.parametrize(
    ("bounds", "retained", "peak"),
    [
        ([(0, 3)], 177, 177),  # no checkpointing: everything saved
        ([(0, 1), (1, 3)], 177, 177),  # input 1 + layers 1-2 {2,3,4}: 100+40+30+7
        ([(0, 2), (2, 3)], 107, 170),  # keep {1} + {4}; recompute seg 0 -> {1,2,3}
        ([(0, 1), (1, 2), (2, 3)], 147, 170),  # keep {1},{2},{4}; recompute seg 1 -> {1,2,3}
    ],
)
def test_checkpointed_segments_table(
    bounds: list[tuple[int, int]], retained: int, peak: int
) -> None:
    assert retained_bytes(SIZES, SAVED, INPUTS, bounds) == retained
    assert checkpointed_bytes(SIZES, SAVED, INPUTS, bounds) == peak


@pytest.mark.parametrize(
    ("acts", "ws", "step_ws", "extra", "expected"),
    [
        (1000, 10, 0, 0, 10 + 40 + 1000 + 10 + 10),  # backward phase dominates
        (0, 0, 50, 0, 10 + 10 + 40 + 50),  # optimizer step dominates
        (1000, 10, 0, 5, 1075),
    ],
)
def test_training_peak_table(acts: int, ws: int, step_ws: int, extra: int, expected: int) -> None:
    got = training_peak_bytes(
        parameters_bytes=10,
        gradients_bytes=10,
        optimizer_bytes=40,
        activations_bytes=acts,
        backward_workspace_bytes=ws,
        step_workspace_bytes=step_ws,
        extra_bytes=extra,
    )
    assert got == expected


# ---------------------------------------------------------------- activations vs real


@pytest.fixture(scope="module")
def r50() -> nn.Module:
    torch.manual_seed(0)
    return resnet50().train()


def deep_mlp() -> nn.Sequential:
    return nn.Sequential(*[m for _ in range(16) for m in (nn.Linear(256, 256), nn.ReLU())])


ACCURACY: list[tuple[str, float]] = []  # filled by the test below, printed with -s


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("housing", (128, 13)),
        ("housing", (512, 13)),
        ("deep_mlp", (32, 256)),
        ("deep_mlp", (64, 256)),
        ("lenet", (32, 1, 28, 28)),
        ("lenet", (64, 1, 28, 28)),
        ("resnet50", (2, 3, 64, 64)),
        ("resnet50", (4, 3, 64, 64)),
    ],
)
def test_activation_estimate_within_10_percent_of_real(
    name: str, shape: tuple[int, ...], r50: nn.Module, run_device: torch.device
) -> None:
    """The estimate (made on fake CPU tensors) against the bytes autograd really saves on
    ``run_device``: on a GPU, cuDNN's kernels may save other tensors than the CPU's."""
    torch.manual_seed(0)
    model = {"housing": HousingNet, "deep_mlp": deep_mlp, "lenet": LeNet5}.get(name, lambda: r50)()
    x = torch.randn(*shape)
    real_model = model if run_device.type == "cpu" else copy.deepcopy(model).to(run_device)
    real = saved_tensor_bytes(lambda: real_model(x.to(run_device)))
    est = estimate_memory(model, torch.empty(*shape, device="meta"), block_bytes=1)
    estimated = est.devices[0].activations_bytes
    ACCURACY.append((f"{name} {shape}", estimated / real))
    print(f"{name} {shape}: real {real} estimated {estimated} ratio {estimated / real:.4f}")
    assert abs(estimated / real - 1) <= 0.10


def test_bf16_activation_estimate_within_10_percent(r50: nn.Module) -> None:
    x = torch.randn(2, 3, 64, 64)

    def forward() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out: torch.Tensor = r50(x)
            return out

    real = saved_tensor_bytes(forward)
    est = measure_activations(r50, x, precision="bf16").saved_bytes
    assert abs(est / real - 1) <= 0.10
    # autocast keeps bf16 copies of the weights for backward: more than fp32 at this size
    assert est > measure_activations(r50, x).saved_bytes


def test_checkpointing_estimate_matches_real_checkpointed_model(r50: nn.Module) -> None:
    for model, x in [(deep_mlp(), torch.randn(64, 256)), (r50, torch.randn(4, 3, 64, 64))]:
        profile = measure_activations(model, x)
        n = len(profile.layer_saved)
        bounds = segment_bounds(n, sqrt_segments(n))
        kept = retained_bytes(profile.sizes, profile.layer_saved, profile.layer_inputs, bounds)
        checkpointed = apply_activation_checkpointing(copy.deepcopy(model))
        real = saved_tensor_bytes(lambda m=checkpointed, x=x: m(x))
        assert abs(kept / real - 1) <= 0.10, (kept, real)
        est = estimate_memory(model, x, activation_checkpointing=True, block_bytes=1)
        plain = estimate_memory(model, x, block_bytes=1, profile=profile)
        # the estimate adds the recompute peak to what stays saved, and still saves a lot
        assert kept <= est.devices[0].activations_bytes < 0.6 * plain.devices[0].activations_bytes


# ---------------------------------------------------------------- strategies


@pytest.fixture(scope="module")
def r50_profile(r50: nn.Module) -> ActivationProfile:
    return measure_activations(r50, torch.empty(8, 3, 64, 64, device="meta"))


def test_strategies_per_device(r50: nn.Module, r50_profile: ActivationProfile) -> None:
    x = torch.empty(8, 3, 64, 64, device="meta")
    kw = {"block_bytes": 1, "profile": r50_profile}
    single = estimate_memory(r50, x, **kw).devices[0]  # type: ignore[arg-type]
    n_params = sum(p.numel() for p in r50.parameters())
    n_buffers = sum(b.numel() * b.element_size() for b in r50.buffers())
    assert single.parameters_bytes == 4 * n_params + n_buffers
    assert single.gradients_bytes == 4 * n_params
    assert single.optimizer_bytes == 2 * 4 * n_params
    assert single.total_bytes == (
        single.parameters_bytes + single.gradients_bytes + single.optimizer_bytes
        + single.activations_bytes
    )  # fmt: skip
    assert single.peak_bytes > single.total_bytes

    ddp = estimate_memory(r50, x, strategy="ddp", world_size=2, **kw)  # type: ignore[arg-type]
    assert [d.device for d in ddp.devices] == ["cuda:0", "cuda:1"]
    assert ddp.devices[0].extra_bytes == single.gradients_bytes  # gradient buckets
    assert ddp.devices[0].activations_bytes == single.activations_bytes

    fsdp = estimate_memory(r50, x, strategy="fsdp", world_size=4, **kw)  # type: ignore[arg-type]
    assert fsdp.devices[0].optimizer_bytes == pytest.approx(single.optimizer_bytes / 4, rel=1e-3)
    assert fsdp.peak_bytes < ddp.peak_bytes

    split = estimate_memory(r50, x, strategy="split", devices=["cuda:0", "cuda:1"], **kw)  # type: ignore[arg-type]
    assert split.balance == (3, 3)
    assert sum(d.parameters_bytes for d in split.devices) == single.parameters_bytes
    # every stage keeps its own copy of the boundary activation
    assert sum(d.activations_bytes for d in split.devices) >= single.activations_bytes
    by_memory = estimate_memory(r50, x, strategy="split", world_size=2, balance="memory", **kw)  # type: ignore[arg-type]
    assert by_memory.peak_bytes <= split.peak_bytes

    pipe = estimate_memory(r50, x, strategy="pipeline", world_size=2, chunks=4, block_bytes=1)
    assert pipe.micro_batch_size == 2
    assert pipe.devices[0].activations_bytes == pytest.approx(
        split.devices[0].activations_bytes, rel=0.05
    )
    ckpt = estimate_memory(
        r50, x, strategy="pipeline", world_size=2, chunks=4, activation_checkpointing=True
    )
    assert ckpt.devices[0].activations_bytes < 0.5 * pipe.devices[0].activations_bytes


def test_model_built_on_meta_is_estimated_without_allocation() -> None:
    # 4 x 16384^2 fp32 = 4 GiB of weights: never allocated.
    with torch.device("meta"):
        big = nn.Sequential(*[nn.Linear(16384, 16384) for _ in range(4)])
    est = estimate_memory(big, torch.empty(4096, 16384, device="meta"), optimizer="adam")
    d = est.devices[0]
    assert d.parameters_bytes >= 4 * 16384 * 16384 * 4
    assert d.optimizer_bytes == 2 * d.gradients_bytes
    assert d.activations_bytes == 4 * 4096 * 16384 * 4  # each Linear saves its input
    assert "cuda:0" in est.format() and est.fits(80 * 2**30)
    assert not est.fits(8 * 2**30)
    assert not torch.cuda.is_initialized()


def test_estimate_errors(r50: nn.Module) -> None:
    x = torch.empty(4, 3, 64, 64, device="meta")
    with pytest.raises(ConfigError, match=r"strategy='zero'"):
        estimate_memory(r50, x, strategy="zero")
    with pytest.raises(ConfigError, match=r"precision='fp8'"):
        estimate_memory(r50, x, precision="fp8")
    with pytest.raises(ConfigError, match=r"chunks=8 .* batch of 4"):
        estimate_memory(r50, x, strategy="pipeline", world_size=2, chunks=8)
    with pytest.raises(ConfigError, match="only applies to strategy='pipeline'"):
        estimate_memory(r50, x, chunks=2)
    with pytest.raises(BalanceError, match=r"covers 5 layers but the model has 6"):
        estimate_memory(r50, x, strategy="split", balance=[2, 3])
    with pytest.raises(ConfigError, match="sample_batch must be a tensor"):
        estimate_memory(r50, "images")

    class NoView(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.fc(x)
            return out

    with pytest.raises(ConfigError, match="NoView has no sequential view"):
        estimate_memory(NoView(), torch.empty(2, 4), strategy="split", world_size=2)
    assert estimate_memory(NoView(), torch.empty(2, 4)).devices[0].activations_bytes > 0

    class ValueDependent(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2 if x.sum() > 0 else x

    with pytest.raises(ConfigError, match="depends on tensor values"):
        estimate_memory(ValueDependent(), torch.empty(2, 4))


# ------------------------------------------------- users' models: any batch structure
def _tiny_lm() -> nn.Module:
    from tests.user_models import TinyCausalLM

    torch.manual_seed(0)
    return TinyCausalLM()


def _tiny_gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=97, n_positions=16, n_embd=32, n_layer=2,
                                     n_head=4, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model: nn.Module = transformers.GPT2LMHeadModel(config)
    return model


def _token_batch(rows: int, seq: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    ids = (torch.arange(rows * seq).reshape(rows, seq) % 11).to(device)
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize(("build", "seq"), [(_tiny_lm, 12), (_tiny_gpt2, 16)])
def test_dict_token_batches_match_the_real_forward(build, seq) -> None:
    model = build().train()
    for rows in (2, 4):
        real = _token_batch(rows, seq)
        meta = _token_batch(rows, seq, "meta")  # int64 ids: shapes and dtype only
        est = estimate_memory(model, meta, optimizer="adam", block_bytes=1)
        measured = saved_tensor_bytes(lambda: model(**real))  # noqa: B023
        assert est.devices[0].activations_bytes == measured
        if rows == 2:
            two = measured
    # activations grow linearly with the batch (less a few batch-independent bytes: the
    # causal mask, scalars)
    assert measured == pytest.approx(2 * two, rel=0.01)
    # states: every distinct parameter once (the tied head is the embedding), Adam x2
    unique = sum(p.numel() * p.element_size() for p in model.parameters())
    named = sum(p.numel() * p.element_size()
                for _, p in model.named_parameters(remove_duplicate=False))
    assert named > unique  # the weights really are tied
    device = est.devices[0]
    assert (device.parameters_bytes, device.gradients_bytes) == (unique, unique)
    optimizer = torch.optim.Adam(model.parameters())
    model(**_token_batch(2, seq)).loss.backward()
    optimizer.step()
    real_state = sum(t.numel() * t.element_size() for s in optimizer.state.values()
                     for t in s.values() if t.dim() > 0)
    assert device.optimizer_bytes == real_state


def test_checkpointed_estimate_of_repeated_blocks() -> None:
    model = _tiny_lm().train()
    batch = _token_batch(8, 12, "meta")
    plain = estimate_memory(model, batch, block_bytes=1).devices[0].activations_bytes
    ckpt = estimate_memory(model, batch, block_bytes=1, activation_checkpointing=True)
    acts = ckpt.devices[0].activations_bytes
    wrapped = apply_activation_checkpointing(copy.deepcopy(model))
    real = _token_batch(8, 12)
    kept = saved_tensor_bytes(lambda: wrapped(**real))  # after the forward: block inputs
    assert kept <= acts < plain / 2, (kept, acts, plain)
    with pytest.raises(ConfigError, match="no sequential view and no repeated block"):
        estimate_memory(nn.Linear(4, 4), torch.empty(2, 4), activation_checkpointing=True)


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.fc = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        h = self.embed(ids) * extra["scale"].unsqueeze(-1)
        return self.fc(h).mean(dim=1)


def test_tuple_and_nested_samples_keep_their_structure_and_dtypes() -> None:
    model = _TwoInputs()
    ids = torch.zeros(4, 5, dtype=torch.long)
    sample = (ids, {"scale": torch.ones(4, 5)})
    est = estimate_memory(model, sample, block_bytes=1)
    measured = saved_tensor_bytes(lambda: model(*sample))
    assert est.batch_size == 4 and est.devices[0].activations_bytes == measured
    # a loss function's saved tensors are counted too
    with_loss = estimate_memory(model, sample, block_bytes=1,
                                loss_fn=lambda out: out.log_softmax(-1).sum())
    assert with_loss.devices[0].activations_bytes > measured
    with pytest.raises(ConfigError, match="got only scalar tensors"):
        estimate_memory(model, {"scale": torch.tensor(1.0)})


def test_a_list_of_blocks_is_split_like_a_sequential() -> None:
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(4))
    est = estimate_memory(blocks, torch.empty(4, 8, device="meta"), strategy="split",
                          world_size=2)
    assert est.balance == (2, 2) and len(est.devices) == 2
