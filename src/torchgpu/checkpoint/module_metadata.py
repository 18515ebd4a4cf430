"""Torch's per-module state-dict metadata (``_metadata``: module path ->
``{"version": N}``) carried through key mappings, so that version-aware loading
(``_load_from_state_dict``) can still upgrade old layouts (a BatchNorm state dict of
version 1 without ``num_batches_tracked``) after keys were stripped or prefixed."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

from torch import nn


def metadata_of(state: object) -> Mapping[object, object] | None:
    """The ``_metadata`` a ``state_dict()`` carries (module path -> ``{"version": N}``),
    or ``None``. Torch's version-aware loading (``_load_from_state_dict`` reading
    ``local_metadata["version"]``) needs it to upgrade old layouts, e.g. a BatchNorm
    state dict of version 1 without ``num_batches_tracked``."""
    metadata = getattr(state, "_metadata", None)
    return metadata if isinstance(metadata, Mapping) else None


def with_metadata(state: Mapping[str, object],
                  metadata: Mapping[str, object] | Mapping[object, object] | None
                  ) -> dict[str, object]:
    """A copy of ``state`` carrying ``metadata`` as ``_metadata`` (an ``OrderedDict``,
    like ``state_dict()`` returns, since a plain dict cannot hold the attribute)."""
    copy: OrderedDict[str, object] = OrderedDict(state)
    if metadata is not None:
        copy._metadata = OrderedDict(metadata)  # type: ignore[attr-defined]
    return copy


def legacy_keys(missing: tuple[str, ...], current: Mapping[str, Mapping[object, object]],
                 metadata: Mapping[str, Mapping[object, object]]) -> set[str]:
    """The ``missing`` target keys that torch's version-aware loading may supply: keys
    owned directly by a module whose current version (``current``: the target's own
    ``state_dict()._metadata``) is above 1 while the source records an older version (or
    none) for it -- BatchNorm's ``num_batches_tracked``, added in version 2, is the
    classic case. Both are keyed by the module paths of the state dict's key space,
    which is not always the module tree (a split model's keys are its inner model's)."""
    found = set()
    for key in missing:
        path, _, _name = key.rpartition(".")
        version = current.get(path, {}).get("version", 1)
        saved = metadata.get(path, {}).get("version")
        if isinstance(version, int) and version > 1 and (
                not isinstance(saved, int) or saved < version):
            found.add(key)
    return found


def key_space_modules(model: nn.Module, target: Mapping[str, object]
                       ) -> dict[str, dict[object, object]]:
    """Module path -> ``{"version": N}`` in the key space of ``model.state_dict()``.

    Taken from the ``_metadata`` torch's ``state_dict()`` records while it walks the
    modules, so it follows whatever the model's ``state_dict`` delegates to (a split
    model or pipeline gives its inner model's keys under ``module.``-less paths; DDP,
    DataParallel and torch.compile keep ``module.`` / ``_orig_mod.``) -- exactly the
    paths ``load_state_dict`` looks versions up under. A state dict without metadata
    falls back to the module tree."""
    recorded = metadata_of(target)
    if recorded is not None:
        return {path: dict(info) for path, info in recorded.items()
                if isinstance(path, str) and isinstance(info, Mapping)}
    return {name: {"version": getattr(type(module), "_version", 1)}
            for name, module in model.named_modules()}


def without_prefix(prefix: str, state: Mapping[str, object],
             metadata: Mapping[str, dict[object, object]] | None) -> dict[str, object]:
    """``state`` (every key starting with ``prefix``) and its module-path ``metadata``
    with ``prefix`` removed; metadata of the wrappers above it is dropped."""
    keys = {k[len(prefix):]: v for k, v in state.items()}
    if metadata is None:
        return with_metadata(keys, None)
    inner = {f"{path}."[len(prefix):].removesuffix("."): info
             for path, info in metadata.items() if f"{path}.".startswith(prefix)}
    return with_metadata(keys, inner)
