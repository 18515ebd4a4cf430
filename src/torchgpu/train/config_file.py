"""``--config FILE.toml`` and the ``config.toml`` every run writes under ``--out``.

A config file holds ``torchgpu train`` settings as top-level TOML keys named like the flags
(``batch_size`` or ``batch-size``); flags on the command line override it. Every run writes
its resolved settings to ``OUT/config.toml``, so ``torchgpu train --config OUT/config.toml
--out NEW`` runs it again (bitwise on CPU; file specs and CSV paths are written absolute,
and the working directory module specs resolve from is recorded in a comment). The
optional ``[run]`` table records where the file came from; ``cli = false`` (a ``fit`` run,
whose model and data were Python objects) is refused on reading. ``[fingerprints]`` holds
the sha256 of the run's files: a replay whose files changed warns. Reading uses
``tomllib`` (``tomli`` on Python 3.10, else a clear error); :func:`dumps` needs no library.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torchgpu.errors import ConfigError, UsageError
from torchgpu.train.config import TrainConfig
from torchgpu.user_files import read_text

CONFIG_FILE = "config.toml"  # OUT/config.toml: the settings a run used
RUN_TABLE = "run"  # metadata, not settings
FINGERPRINTS_TABLE = "fingerprints"  # {path: sha256} of the run's files, not settings
# Settings a reproduced run must not inherit: continuing or removing a run, the launcher's
# node-specific addresses, and what only changes how the result is printed.
_NOT_WRITTEN = frozenset({"resume", "trust_checkpoint", "force_resume", "overwrite",
                          "autoresume", "node_rank", "rdzv_endpoint", "rdzv_timeout", "gpus",
                          "json",
                          "progress"})


def _field_types() -> dict[str, tuple[type, ...]]:
    """Setting name -> the Python types its TOML value may have."""
    hints = typing.get_type_hints(TrainConfig)
    types: dict[str, tuple[type, ...]] = {}
    for f in dataclasses.fields(TrainConfig):
        allowed = tuple(t for t in typing.get_args(hints[f.name]) or (hints[f.name],)
                        if t is not type(None))
        types[f.name] = allowed
    return types


def _type_name(types: tuple[type, ...]) -> str:
    names = {bool: "true/false", int: "an integer", float: "a number", str: "a string"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def _load_toml(text: str, path: str) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef,import-not-found,unused-ignore]
        except ModuleNotFoundError:
            raise UsageError(
                f"--config {path} needs a TOML reader: Python 3.11+ has one (tomllib); on "
                "Python 3.10 install tomli (pip install tomli), or pass the settings as flags."
            ) from None
    try:
        return dict(tomllib.loads(text))
    except tomllib.TOMLDecodeError as error:
        _refuse_repeats(text, path, {})  # a key given twice: name both of its lines
        raise ConfigError(
            f"--config {path} is not valid TOML ({error}): fix the file, e.g. "
            'batch_size = 32 and strategy = "ddp", one setting per line.'
        ) from None


def read_settings(path: str, keys: dict[str, str] | None = None,
                  fingerprints: dict[str, str] | None = None) -> dict[str, Any]:
    """The settings in the TOML file at ``path``, by field name (dashes become
    underscores), type-checked against :class:`TrainConfig`. ``keys``, when given, is
    filled with each setting's key as the file spells it; ``fingerprints`` with its
    ``[fingerprints]`` table (path -> sha256; entries of another shape are left out).

    Raises UsageError for a missing file or a file written by ``fit`` (``[run]`` has
    ``cli = false``), ConfigError for bad TOML, an unknown key or a value of the wrong
    type (naming the key, the value and what is allowed).
    """
    text = read_text(path, what="--config", fix=f"Pass the path of a TOML file with "
                     f"settings, e.g. a previous run's OUT/{CONFIG_FILE}.")
    # Editors on Windows often start a UTF-8 file with a byte-order mark, which TOML
    # does not allow: it carries no setting, so it is dropped rather than refused.
    text = text.removeprefix("\ufeff")
    raw = _load_toml(text, path)
    _refuse_repeats(text, path, raw)
    meta = raw.pop(RUN_TABLE, {})
    recorded = raw.pop(FINGERPRINTS_TABLE, {})
    if fingerprints is not None and isinstance(recorded, Mapping):
        fingerprints.update({k: v for k, v in recorded.items() if isinstance(v, str)})
    if isinstance(meta, Mapping) and meta.get("cli") is False:
        raise UsageError(
            f"--config {path} was written by torchgpu.fit(), whose model and data were "
            "Python objects that a config file cannot rebuild: call fit() again from your "
            "script with these settings, or write --model/--data specs into the file and "
            "delete its [run] table."
        )
    types = _field_types()
    settings: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in types:
            raise ConfigError(
                f"--config {path}: unknown setting {key!r}. The settings are the `torchgpu "
                f"train` flags' names: {', '.join(sorted(types))}. Fix or delete that line."
            )
        allowed = types[name]
        ok = isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed)
        if isinstance(value, int) and not isinstance(value, bool) and float in allowed:
            ok, value = True, float(value)  # lr = 1 means 1.0
        if name == "batch_size" and value == "auto":
            ok = True  # --batch-size auto
        if not ok:
            hint = (' (resume = "" continues the run in out from its latest checkpoint, '
                    'resume = "DIR" from DIR)' if name == "resume" else "")
            raise ConfigError(
                f"--config {path}: {key} = {_shown(value)} has the wrong type: it must be "
                f"{_type_name(allowed)}{hint}. Fix that line, e.g. {name} = "
                f"{_example(allowed)}."
            )
        settings[name] = value
        if keys is not None:
            keys[name] = key
    return settings


# A top-level ``key = value`` line: the key bare or quoted (the value is not read here).
_KEY_LINE = re.compile(r"""\s*(?:([A-Za-z0-9_-]+)|"([^"\\]*)"|'([^']*)')\s*=""")


def _refuse_repeats(text: str, path: str, raw: Mapping[str, Any]) -> None:
    """Refuse one setting given twice at the top level of the file, under one spelling
    (``batch_size`` twice, which TOML itself rejects) or two (``batch_size`` and
    ``batch-size``, which it takes as two keys), naming both lines. ``raw``: the parsed
    file ({} when it did not parse); a repeat under two spellings counts only when both
    keys are in it, so text inside a multi-line string is never mistaken for a line."""
    seen: dict[str, tuple[int, str]] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("["):
            return  # a table begins: the settings are above it
        match = _KEY_LINE.match(line)
        if match is None:
            continue
        key = next(group for group in match.groups() if group is not None)
        name = key.replace("-", "_")
        if name in seen:
            first, spelled = seen[name]
            if spelled == key and raw:
                continue  # parsed as one key: this line is inside a multi-line value
            if spelled != key and not (spelled in raw and key in raw):
                continue
            raise ConfigError(
                f"--config {path} sets {name} twice: line {first} ({spelled} = ...) and "
                f"line {number} ({key} = ...); `_` and `-` spell the same setting, so the "
                "file does not say which value it means. Delete one of the two lines."
            )
        seen[name] = (number, key)


def _shown(value: Any) -> str:
    """``value`` as TOML writes it, where it can."""
    try:
        return _value(value)
    except TypeError:
        return repr(value)


@dataclasses.dataclass(frozen=True)
class FileSettings:
    """The settings a run took from ``--config path``: ``{name: (key, value)}``, only
    those the command line did not override; ``fingerprints``: the file's
    ``[fingerprints]`` table (path -> sha256 of the files its run was built from)."""

    path: str
    values: Mapping[str, tuple[str, Any]]
    fingerprints: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def changed_lines(self, config: TrainConfig) -> list[str]:
        """A warning line for each file of ``config`` that differs from its recorded
        fingerprint: the replay runs the file as it is now, which may not reproduce the
        run the file records."""
        from torchgpu.train.fingerprints import changed_files

        return [f"warning: --config {self.path} recorded {change.words()}: it changed "
                "since that run, so this run uses it as it is now and may not reproduce "
                "that run." for change in changed_files(self.fingerprints, config)]

    def name_keys(self, error: BaseException) -> None:
        """Make ``error``'s message name the file's keys instead of the flags: a value
        that came from the file is wrong there, not on the command line. ``--epochs 0``
        becomes ``epochs = 0`` (and a bare ``--epochs``, ``epochs``) and the message starts
        with ``--config PATH:``; a message that names none of them is left as it is."""
        text = str(error)
        named = text
        for name, (key, value) in self.values.items():
            flag = re.escape("--" + name.replace("_", "-"))
            this = f"{key} = {_shown(value)}"
            shown = {str(value), repr(value)} | ({f"{value:g}"} if isinstance(value, float)
                                                 else set())
            for spelled in sorted(shown, key=len, reverse=True):  # the file's value
                named = re.sub(rf"{flag} {re.escape(spelled)}(?![\w.-])",
                               this.replace("\\", "\\\\"), named)
            # another number in the same place (an example of a good value)
            named = re.sub(rf"{flag} (-?\d[\d.]*(?:e[+-]?\d+)?)(?![\w.-])", rf"{key} = \1",
                           named)
            named = re.sub(rf"{flag}(?![\w-])", key, named)
        if named != text:
            error.args = (f"--config {self.path}: {named}",)


def _example(types: tuple[type, ...]) -> str:
    if bool in types:
        return "true"
    if int in types:
        return "4"
    if float in types:
        return "0.001"
    return '"value"'


def _absolute_spec(spec: str | None) -> str | None:
    """A file spec (``path/to/file.py:attr``) or a CSV path, made absolute so the file
    works from any directory; module specs (``package.module:attr``) are kept."""
    if spec is None or spec.startswith("fit:"):
        return spec
    location, sep, attr = spec.rpartition(":")
    if sep and (location.endswith(".py") or os.sep in location or "/" in location):
        return f"{os.path.abspath(location)}:{attr}"
    if not sep and (spec.endswith(".csv") or os.path.exists(spec)):
        return os.path.abspath(spec)
    return spec


def _absolute_name(value: str | None) -> str | None:
    """``--loss`` / ``--optimizer``: a built-in name (``mse``, ``adam``) as it is, a file
    spec made absolute."""
    return _absolute_spec(value) if value is not None and ":" in value else value


def _resolved_run(config: TrainConfig, device: str | None, model: Any) -> dict[str, Any]:
    """What ``auto`` settings resolved to in this run, as settings: ``device`` (the
    device it trained on: a bare ``cuda`` under several processes, which means each
    rank's own GPU), ``precision`` (the mode ``auto`` picked on it), and for a model
    split in one process (``model`` a SplitModel/Pipeline) its stage ``devices``, the
    layers per stage (``balance``, also when measured by ``size``/``time``) and the
    micro-batches the split-size sweep chose (``chunks``). A value not known here (no
    ``model`` given, the one-stage-per-process pipeline) is kept as written."""
    values: dict[str, Any] = {}
    split = config.strategy in ("model", "pipeline")
    if device is not None:
        if config.device == "auto" and not split:
            # several processes: "cuda" is each rank's cuda:LOCAL_RANK (build.choose_device)
            values["device"] = device.split(":", 1)[0] if config.nproc else device
        if config.precision == "auto":
            from torchgpu.precision import resolve_mode

            values["precision"] = resolve_mode(config.precision, device)
    from torchgpu.parallel.model import SplitModel

    if isinstance(model, SplitModel):
        if config.devices is None:
            values["devices"] = ",".join(str(d) for d in model.devices)
        values["balance"] = ",".join(str(n) for n in model.balance)
        chunks = getattr(model, "chunks", None)
        if isinstance(chunks, int) and not isinstance(chunks, bool):
            values["chunks"] = chunks
    return values


def settings_to_write(config: TrainConfig, *, world_size: int = 1, local_world_size: int = 1,
                      device: str | None = None, model: Any = None) -> dict[str, Any]:
    """The settings of ``config`` (resolved) that reproduce the run: launch-only and
    output-only settings left out, paths and file specs made absolute (``model``,
    ``data``, ``loss``, ``optimizer``, ``out``), the process count of the run (``world_size``
    processes, ``local_world_size`` per node) filled in, and what ``auto`` resolved to
    on ``device`` with the wrapped ``model`` (see :func:`_resolved_run`)."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(TrainConfig)
              if f.name not in _NOT_WRITTEN}
    values["model"] = _absolute_spec(config.model)
    values["loss"] = _absolute_name(config.loss)
    values["optimizer"] = _absolute_name(config.optimizer)
    values["scheduler"] = _absolute_name(config.scheduler)
    values["collate_fn"] = _absolute_spec(config.collate_fn)
    if config.metrics is not None:
        values["metrics"] = ",".join(str(_absolute_name(item.strip()))
                                     for item in config.metrics.split(","))
    if config.model is not None and config.target is None:
        values["data"] = _absolute_spec(config.data)  # a data spec
    elif config.data is not None:
        values["data"] = os.path.abspath(config.data)  # a CSV file
    if config.out is not None:
        values["out"] = os.path.abspath(config.out)
    if config.auto_batch_size and config.batch_size is not None:
        values["auto_batch_size"] = False  # the searched size ran: keep it, do not search
        values["effective_batch_size"] = None
    if world_size > 1:
        values["nproc"] = local_world_size
        values["nnodes"] = max(1, world_size // max(local_world_size, 1))
    else:
        values["nproc"] = None
        values["nnodes"] = 1
    values.update(_resolved_run(dataclasses.replace(config, nproc=values["nproc"]), device,
                                model))
    return values


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # the shortest repr that round-trips, always with . or e
    if isinstance(value, str):
        return json.dumps(value)  # JSON escapes are TOML basic-string escapes
    raise TypeError(f"cannot write {type(value).__name__} {value!r} to TOML")


def dumps(settings: Mapping[str, Any], run: Mapping[str, Any] | None = None,
          comments: tuple[str, ...] = (), fingerprints: Mapping[str, str] | None = None
          ) -> str:
    """TOML text: ``comments`` as ``#`` lines, then ``settings`` as top-level keys
    (``None`` values left out), then ``run`` as the ``[run]`` table and
    ``fingerprints`` (path -> sha256) as the ``[fingerprints]`` table."""
    lines = [f"# {line}" for line in comments]
    lines += [f"{key} = {_value(v)}" for key, v in settings.items() if v is not None]
    if run:
        lines += ["", f"[{RUN_TABLE}]"]
        lines += [f"{key} = {_value(v)}" for key, v in run.items() if v is not None]
    if fingerprints:
        lines += ["", f"[{FINGERPRINTS_TABLE}]"]
        lines += [f"{_value(path)} = {_value(digest)}" for path, digest in fingerprints.items()]
    return "\n".join(lines) + "\n"


def write_config(out_dir: Path, config: TrainConfig, *, world_size: int, local_world_size: int,
                 device: str, model: Any = None,
                 fingerprints: Mapping[str, str] | None = None) -> Path:
    """Write ``OUT/config.toml`` for ``config`` (the settings that ran, ``auto`` values
    resolved on ``device`` and with the wrapped ``model``: :func:`settings_to_write`;
    ``fingerprints``: the run's files' sha256 by path) and return its path.

    A :func:`torchgpu.fit` run (``model`` is ``fit:<name>``: its model and data were
    objects) still records its settings; the file says it cannot be re-run from the
    command line, and ``read_settings`` refuses it.
    """
    from torchgpu.version import versions

    from_fit = (config.model or "").startswith("fit:")

    settings = settings_to_write(config, world_size=world_size,
                                 local_world_size=local_world_size, device=device, model=model)
    comments: tuple[str, ...]
    if from_fit:
        comments = ("Settings of a torchgpu.fit() run. Its model and data were Python objects,",
                    "so `torchgpu train --config` cannot re-run it: call fit() with these.")
    else:
        comments = ("The settings this run used. Run it again with:",
                    f"  torchgpu train --config {out_dir / CONFIG_FILE} --out NEW_DIR",
                    f"Module specs resolve from the working directory it ran in: {os.getcwd()}")
    info = versions()
    run = {"cli": not from_fit, "device": device, "world_size": world_size,
           "torch": info["torch"], "torchgpu": info["torchgpu"]}
    from torchgpu.checkpoint.atomic import write_file_atomic

    return write_file_atomic(out_dir / CONFIG_FILE,
                             dumps(settings, run, comments, fingerprints).encode("utf-8"))
