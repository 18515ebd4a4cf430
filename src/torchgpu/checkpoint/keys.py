"""Loading weights saved under any wrapper into any wrapper, by matching keys.

Source and target keys are compared after dropping ``_orig_mod`` path components
(torch.compile's wrapper, never a real attribute). Then every candidate mapping
"strip prefix P from the source, add prefix Q" is scored, where P ranges over the
source's frequent leading prefixes (``module.``, ``model.``, ``model.module.``...) and Q
over the target's, and the mapping that places the most source tensors on target keys
of the same shape wins. Nothing is sliced by position: ``module.`` is only removed when
that makes the keys match.

Containers are unpacked the same way: for a dict that is not itself a state dict
(Lightning ``{"state_dict": ...}``, Fabric ``{"model": ..., "optimizer": ...}``, the
usual ``{"model_state_dict": ...}``), every nested mapping of tensors is a candidate and
the best-scoring one is used.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeGuard

import torch
from torch import nn

from torchgpu.checkpoint.module_metadata import (
    key_space_modules,
    legacy_keys,
    metadata_of,
    with_metadata,
    without_prefix,
)
from torchgpu.checkpoint.ties import tie_groups, tied_elsewhere
from torchgpu.errors import CheckpointError

_COMPILE = "_orig_mod"
_MAX_PREFIX_DEPTH = 3
_MAX_CANDIDATES = 16
_SHOW = 5


@dataclass(frozen=True)
class KeyMapping:
    """How source keys were mapped onto a model's keys, and what did not fit.

    ``strip``/``add``: the prefix removed from source keys / added for the target (after
    ``_orig_mod.`` components are ignored on both sides). ``container``: where in the
    loaded object the weights were found (``""`` for a bare state dict, ``"state_dict"``
    for Lightning, ``"model"`` for Fabric...). ``missing``: target keys not loaded;
    ``unexpected``: source keys not used; ``mismatched``: ``(key, source shape, target
    shape)``.
    """

    strip: str
    add: str
    container: str
    matched: int
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    mismatched: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = field(default=())

    @property
    def exact(self) -> bool:
        """True when every key on both sides found its partner with the same shape."""
        return not (self.missing or self.unexpected or self.mismatched)

    def describe(self) -> str:
        """One line: the mapping in words."""
        where = f"{self.container!r} of the file, " if self.container else ""
        steps = [f"strip {self.strip!r}"] if self.strip else []
        steps += [f"add {self.add!r}"] if self.add else []
        change = ", ".join(steps) if steps else "keys as they are"
        return f"{where}{change} ({self.matched} keys matched)"


def normalize(key: str) -> str:
    """``key`` without ``_orig_mod`` components (torch.compile's wrapper)."""
    return ".".join(part for part in key.split(".") if part != _COMPILE)


def is_state_dict(obj: object) -> TypeGuard[Mapping[str, object]]:
    """A non-empty mapping of str keys whose values are mostly tensors."""
    if not isinstance(obj, Mapping) or not obj:
        return False
    if not all(isinstance(k, str) for k in obj):
        return False
    tensors = sum(isinstance(v, torch.Tensor) for v in obj.values())
    return tensors > 0 and tensors >= len(obj) / 2


def remap_metadata(metadata: Mapping[object, object], strip: str, add: str,
                   modules: Mapping[str, str] | None = None
                   ) -> OrderedDict[str, dict[object, object]]:
    """``metadata`` re-keyed the way keys are mapped: module path ``P`` (keys ``P.x``)
    becomes the path of ``add + (P. without strip)``, ``_orig_mod`` components ignored.
    With ``modules`` (normalised path -> real path of the target's modules), entries for
    modules the target lacks are dropped and the target's real paths are used."""
    mapped: OrderedDict[str, dict[object, object]] = OrderedDict()
    for path, info in metadata.items():
        if not isinstance(path, str) or not isinstance(info, Mapping):
            continue
        norm = normalize(path)
        prefix = f"{norm}." if norm else ""
        if not prefix.startswith(strip):
            continue
        new = (add + prefix[len(strip):]).removesuffix(".")
        real = new if modules is None else modules.get(new)
        if real is not None:
            mapped[real] = dict(info)
    return mapped


def candidate_states(obj: object, max_depth: int = 2) -> list[tuple[str, dict[str, object]]]:
    """Every mapping of tensors inside ``obj`` (itself included), with its location;
    each keeps the ``_metadata`` its source had."""
    found: list[tuple[str, dict[str, object]]] = []

    def visit(value: object, where: str, depth: int) -> None:
        if is_state_dict(value):
            found.append((where, with_metadata(value, metadata_of(value))))
        if depth < max_depth and isinstance(value, Mapping):
            for key, item in value.items():
                if isinstance(key, str) and isinstance(item, Mapping):
                    visit(item, f"{where}.{key}" if where else key, depth + 1)

    visit(obj, "", 0)
    return found


def _prefixes(keys: list[str]) -> list[str]:
    counts: Counter[str] = Counter()
    for key in keys:
        parts = key.split(".")
        for depth in range(1, min(_MAX_PREFIX_DEPTH, len(parts) - 1) + 1):
            counts[".".join(parts[:depth]) + "."] += 1
    total = len(keys)
    frequent = [p for p, n in counts.most_common() if n == total or n >= max(2, total // 4)]
    return ["", *frequent[:_MAX_CANDIDATES]]


def _shape(value: object) -> tuple[int, ...] | None:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _evaluate(
    source: Mapping[str, object], source_norm: list[str], target: Mapping[str, object],
    target_by_norm: Mapping[str, str], strip: str, add: str, container: str,
) -> tuple[KeyMapping, dict[str, str]]:
    """Score mapping (strip, add); returns the report and {source key: target key}."""
    pairs: dict[str, str] = {}
    mismatched = []
    unexpected = []
    used: set[str] = set()
    for key, norm in zip(source, source_norm, strict=True):
        real = target_by_norm.get(add + norm[len(strip):]) if norm.startswith(strip) else None
        if real is None:
            unexpected.append(key)
            continue
        used.add(real)
        src_shape, dst_shape = _shape(source[key]), _shape(target[real])
        if src_shape is not None and dst_shape is not None and src_shape != dst_shape:
            mismatched.append((key, src_shape, dst_shape))
            continue
        pairs[key] = real
    missing = tuple(k for k in target if k not in used)
    report = KeyMapping(strip=strip, add=add, container=container, matched=len(pairs),
                        missing=missing, unexpected=tuple(unexpected),
                        mismatched=tuple(mismatched))
    return report, pairs


def match_keys(
    candidates: list[tuple[str, dict[str, object]]], target: Mapping[str, object],
) -> tuple[KeyMapping, dict[str, str], dict[str, object]]:
    """The best (report, pairs, source) over all candidate containers and prefix maps.

    Score: most matched keys, then fewest shape mismatches, then fewest unexpected keys,
    then the shortest prefixes (the least surprising mapping).
    """
    target_by_norm = {normalize(k): k for k in target}
    target_norm = list(target_by_norm)
    best: tuple[tuple[int, ...], KeyMapping, dict[str, str], dict[str, object]] | None = None
    for container, source in candidates:
        source_norm = [normalize(k) for k in source]
        for strip in _prefixes(source_norm):
            for add in _prefixes(target_norm):
                report, pairs = _evaluate(source, source_norm, target, target_by_norm, strip,
                                          add, container)
                score = (report.matched, -len(report.mismatched), -len(report.unexpected),
                         -len(strip) - len(add))
                if best is None or score > best[0]:
                    best = (score, report, pairs, source)
    if best is None:
        raise CheckpointError(
            "the checkpoint holds no tensors keyed by name (no state dict found at the top "
            "level or under keys such as 'state_dict' or 'model'); pass a model state dict")
    return best[1], best[2], best[3]


def _fmt_keys(keys: tuple[str, ...], shapes: Mapping[str, object]) -> str:
    shown = [f"{k} {list(s) if (s := _shape(shapes.get(k))) is not None else '(non-tensor)'}"
             for k in keys[:_SHOW]]
    more = f" and {len(keys) - _SHOW} more" if len(keys) > _SHOW else ""
    return ", ".join(shown) + more


def mapping_error(report: KeyMapping, source: Mapping[str, object],
                  target: Mapping[str, object], origin: str) -> CheckpointError:
    """The error for a mapping that does not fit: the key/shape diff, one paragraph."""
    parts = [f"the weights in {origin} do not fit the model; the closest mapping tried was "
             f"{report.describe()}."]
    if report.missing:
        parts.append(f"Missing in the checkpoint ({len(report.missing)}): "
                     f"{_fmt_keys(report.missing, target)}.")
    if report.unexpected:
        parts.append(f"Unexpected in the checkpoint ({len(report.unexpected)}): "
                     f"{_fmt_keys(report.unexpected, source)}.")
    if report.mismatched:
        shown = ", ".join(f"{k} checkpoint {list(a)} vs model {list(b)}"
                          for k, a, b in report.mismatched[:_SHOW])
        more = (f" and {len(report.mismatched) - _SHOW} more"
                if len(report.mismatched) > _SHOW else "")
        parts.append(f"Shape mismatches ({len(report.mismatched)}): {shown}{more}.")
    parts.append("Check that the model is built with the same architecture and sizes, or pass "
                 "strict=False to load the keys that do fit.")
    return CheckpointError(" ".join(parts))


def _loader(model: nn.Module) -> tuple[nn.Module, str]:
    """``(module, prefix)``: the module to call ``load_state_dict`` on, and the prefix its
    keys lack compared with ``model.state_dict()``.

    Normally ``(model, "")``. When ``model`` wraps (DataParallel, DDP, torch.compile, in
    any nesting) a module with its own ``load_state_dict`` -- a split model or pipeline,
    whose keys are its inner model's, not its module paths -- torch's recursion through
    the wrapper would look for the keys under the real paths (``module.module.0.weight``)
    and load nothing, so the wrappers (which hold no state) are peeled off and that
    module loads the keys without their prefix."""
    inner, prefix = model, ""
    while True:
        compiled = getattr(inner, _COMPILE, None)
        if type(inner).__name__ == "OptimizedModule" and isinstance(compiled, nn.Module):
            inner, prefix = compiled, prefix + f"{_COMPILE}."
        elif isinstance(inner, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            inner, prefix = inner.module, prefix + "module."
        else:
            break
    if type(inner).load_state_dict is nn.Module.load_state_dict:
        return model, ""
    return inner, prefix


def load_state_dict(
    model: nn.Module, state_or_path: Mapping[str, object] | str | Path, strict: bool = True, *,
    trust: bool = False, verify: bool = True,
) -> KeyMapping:
    """Load weights saved from any wrapper (plain, DataParallel, DDP, FSDP full state,
    torch.compile, compile(DDP), Lightning, Fabric, Accelerate, ``module.``-prefixed
    layouts) into ``model``, whatever wraps it, and return the :class:`KeyMapping` used.

    ``state_or_path`` is a state dict, a checkpoint-like dict, or a path (``.pt``,
    ``.pth``, ``.bin``, ``.ckpt``, ``.safetensors``, a torchgpu checkpoint directory, a
    directory of them, a ``torchgpu train`` run directory, an Accelerate/Hugging Face
    directory). A torchgpu checkpoint directory is verified against its manifest first
    (a missing manifest is a :class:`CheckpointCorruptError`; ``verify=False`` loads it
    unverified). ``strict=True`` requires every key on both sides to match with equal
    shapes, a tied tensor's names counting as present when any one is (the checkpoint's
    values for two of them must then agree: :mod:`torchgpu.checkpoint.ties`); otherwise
    :class:`CheckpointError` shows the missing, unexpected and shape-mismatched keys and
    the closest mapping tried. The state dict's ``_metadata``
    (module versions) is mapped with the keys and passed on, so torch's version-aware
    loading upgrades old layouts exactly as ``module.load_state_dict`` does (a version-1
    BatchNorm state without ``num_batches_tracked`` loads strictly). With
    ``strict=False`` the keys that fit are loaded and ``missing`` reports what was not.
    """
    if isinstance(state_or_path, (str, Path)):
        from torchgpu.checkpoint.files import show
        from torchgpu.checkpoint.sources import read_weights

        if str(state_or_path) == "":
            raise CheckpointError("the checkpoint path is empty; pass a checkpoint file or "
                                  "directory (an empty path would mean the current directory)")
        obj: Any = read_weights(Path(state_or_path), trust=trust, verify=verify)
        origin = show(state_or_path)
    elif isinstance(state_or_path, Mapping):
        obj = state_or_path
        origin = "the given state dict"
    else:
        raise CheckpointError(
            f"load_state_dict got a {type(state_or_path).__name__} to load; pass a state dict "
            "(a mapping of names to tensors) or the path of a checkpoint")
    target = model.state_dict()
    candidates = candidate_states(obj)
    if not candidates and not target and isinstance(obj, Mapping) and not obj:
        candidates = [("", {})]  # nothing to load into a model with no state: torch agrees
    report, pairs, source = match_keys(candidates, target)
    saved = metadata_of(source)
    current = key_space_modules(model, target)
    modules = {normalize(path): path for path in current}
    metadata = (remap_metadata(saved, report.strip, report.add, modules)
                if saved is not None else None)
    ties = tie_groups(target)
    tied = tied_elsewhere(target, pairs.values(), ties)  # loaded through another name
    legacy = legacy_keys(report.missing, current, metadata or {})
    expected = replace(report, missing=tuple(k for k in report.missing
                                             if k not in legacy and k not in tied))
    if (strict and not expected.exact) or (report.matched == 0 and not expected.exact):
        raise mapping_error(expected if strict else report, source, target, origin)
    not_tensors = [f"{k} ({type(source[k]).__name__})" for k in source
                   if k in pairs and isinstance(target[pairs[k]], torch.Tensor)
                   and not isinstance(source[k], torch.Tensor)]
    if not_tensors:
        raise CheckpointError(
            f"the weights in {origin} hold values that are not tensors where the model has "
            f"tensors: {', '.join(not_tensors[:_SHOW])}"
            f"{f' and {len(not_tensors) - _SHOW} more' if len(not_tensors) > _SHOW else ''}; "
            "nothing was loaded. Convert them with torch.as_tensor(...) or use a state dict "
            "saved by model.state_dict()")
    loader, prefix = _loader(model)
    remapped = without_prefix(prefix, {pairs[k]: source[k] for k in source if k in pairs}, metadata)
    # strict=False here: the strict check was done above, before any weight was copied,
    # and torch's own check would fail on the keys its version-aware loading supplies.
    try:
        result = loader.load_state_dict(remapped, strict=False)
    except RuntimeError as error:  # a module's own loading hook refused a value
        reason = " ".join(str(error).split())
        raise CheckpointError(
            f"the weights in {origin} could not be copied into the model ({reason[:400]}); "
            "check that the checkpoint was saved from the same architecture") from None
    missing = tuple(prefix + k for k in result.missing_keys if prefix + k not in tied)
    unexpected = tuple(prefix + k for k in result.unexpected_keys)
    report = replace(report, missing=missing)
    if strict and (missing or unexpected):
        raise mapping_error(replace(report, unexpected=unexpected), source,
                            target, origin + " (the older module versions it records did not "
                            "supply them)")
    return report
