"""A model's repeated block: the module class that activation checkpointing wraps.

:func:`find_repeated_blocks` picks, among the modules repeated in an ``nn.ModuleList`` or
``nn.Sequential`` anywhere in a model, the class holding the largest share of the
parameters (a transformer block, a ResNet bottleneck). Used by
:func:`~torchgpu.memory.activation_checkpointing.apply_activation_checkpointing` and by
the activation estimate (:mod:`torchgpu.memory.estimate.activations`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from torchgpu.parallel.data import unwrap

# Containers whose children are a model's repeated layers.
CONTAINERS = (nn.Sequential, nn.ModuleList)
# Modules without a forward of their own: never blocks.
NO_FORWARD = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
# A candidate within this fraction of the best parameter share is "as good": a model's
# own block class then beats a plain Sequential holding the same layers.
NEAR_BEST = 0.9


@dataclass(frozen=True)
class RepeatedBlocks:
    """The modules :func:`find_repeated_blocks` (or ``blocks=``) picked.

    ``class_name``: their class (``GPT2Block``; ``Sequential`` for plain Sequential
    blocks); ``names``: their names in ``model.named_modules()``; ``parameter_share``:
    the fraction of the model's parameters (tied ones counted once) inside them.
    """

    class_name: str
    names: tuple[str, ...]
    parameter_share: float

    @property
    def count(self) -> int:
        """How many blocks."""
        return len(self.names)


def _signature(module: nn.Module) -> object:
    # Blocks are "the same" when their classes are; plain Sequentials when their layers'
    # classes are (a stage of three conv-bn-relu Sequentials is a repeat, a stem is not).
    if type(module) is nn.Sequential:
        return (nn.Sequential, tuple(type(c) for c in module.children()))
    return type(module)


def unique_numel(modules: list[nn.Module]) -> int:
    seen: dict[int, int] = {}
    for module in modules:
        for p in module.parameters():
            seen[id(p)] = p.numel()
    return sum(seen.values())


def outermost(named: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """``named`` less the modules nested inside another of them (wrapped once)."""
    names = [n for n, _ in named]
    return [(n, m) for n, m in named if not any(n.startswith(o + ".") for o in names if o != n)]


def _block_candidates(model: nn.Module) -> list[tuple[object, list[tuple[str, nn.Module]]]]:
    groups: dict[object, list[tuple[str, nn.Module]]] = {}
    seen: set[int] = set()
    for name, container in model.named_modules():
        if not isinstance(container, CONTAINERS):
            continue
        siblings: dict[object, list[tuple[str, nn.Module]]] = {}
        for child_name, child in container.named_children():
            # a block runs a composite forward: a lone Linear or ReLU is a layer, and
            # checkpointing one saves nothing (its saved input is what checkpoint keeps)
            if isinstance(child, NO_FORWARD) or next(child.children(), None) is None:
                continue
            full = f"{name}.{child_name}" if name else child_name
            siblings.setdefault(_signature(child), []).append((full, child))
        for key, members in siblings.items():
            if len(members) >= 2:
                for full, child in members:
                    if id(child) not in seen:
                        seen.add(id(child))
                        groups.setdefault(key, []).append((full, child))
    return [(key, outermost(members)) for key, members in groups.items()]


def find_repeated_blocks(model: nn.Module) -> RepeatedBlocks | None:
    """The repeated block of ``model``, or None when it has none.

    Candidates are modules with children of their own, repeated (>= 2 of one class, or
    plain Sequentials of the same layer classes) among the children of an
    ``nn.ModuleList`` or ``nn.Sequential`` anywhere in the model; blocks of one class
    in several containers (a ResNet's stages) count together. The candidate holding the
    largest share of the parameters wins; among candidates within :data:`NEAR_BEST` of
    that share, a model's own class beats plain Sequentials, then the one with more
    blocks. Blocks without parameters are never chosen.
    """
    model = unwrap(model)
    total = unique_numel([model])
    if total == 0:
        return None
    scored = []
    for index, (key, members) in enumerate(_block_candidates(model)):
        if len(members) < 2:
            continue
        share = unique_numel([m for _, m in members]) / total
        if share > 0:
            scored.append((share, key, members, index))
    if not scored:
        return None
    best = max(share for share, *_ in scored)
    near = [row for row in scored if row[0] >= NEAR_BEST * best]
    share, key, members, _ = max(
        near, key=lambda r: (not isinstance(r[1], tuple), len(r[2]), r[0], -r[3])
    )
    cls = key[0] if isinstance(key, tuple) else key
    assert isinstance(cls, type)
    return RepeatedBlocks(cls.__name__, tuple(n for n, _ in members), share)


def composite_classes(model: nn.Module, limit: int = 12) -> list[str]:
    """The classes in ``model`` that could be named as its block (modules with layers of
    their own, the model itself and containers left out), as ``"Name x count"``: the
    repeated candidates of :func:`find_repeated_blocks` first, then the rest, most
    frequent first; at most ``limit``."""
    model = unwrap(model)
    counts: dict[str, int] = {}
    for name, module in model.named_modules():
        if name and not isinstance(module, NO_FORWARD) and next(module.children(), None):
            counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
    repeated = {(key[0] if isinstance(key, tuple) else key).__name__  # type: ignore[union-attr]
                for key, members in _block_candidates(model) if len(members) >= 2}
    ordered = sorted(counts, key=lambda c: (c not in repeated, -counts[c], c))
    return [f"{c} x{counts[c]}" for c in ordered[:limit]]
