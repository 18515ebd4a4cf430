"""fit's settings are typed (FitSettings) with the CLI flags' names, one source of truth
(TrainConfig) for names and defaults: a misspelt or mistyped setting is an error for
mypy and, at run time, one paragraph naming the closest setting."""

from __future__ import annotations

import inspect
import typing
from pathlib import Path

import pytest
from torch import nn

from torchgpu import fit
from torchgpu.errors import UsageError
from torchgpu.train.config import TrainConfig
from torchgpu.train.fit_settings import (
    FIT_ONLY,
    NOT_SETTINGS,
    OWN_ARGUMENTS,
    SETTINGS,
    FitSettings,
)


def _union(hint: object) -> set[object]:
    """The members of a type hint's union (a plain type: itself)."""
    args = typing.get_args(hint)
    return set(args) if typing.get_origin(hint) in (typing.Union, type(int | str)) else {hint}


def test_fit_settings_and_train_config_do_not_drift() -> None:
    """Every TrainConfig field is a typed setting of fit, one of its own keyword
    arguments, or a command-line-only field; fit takes at least every type the config
    field holds."""
    fields = {f.name for f in __import__("dataclasses").fields(TrainConfig)}
    typed = set(typing.get_type_hints(FitSettings))
    assert typed == set(SETTINGS) - set(OWN_ARGUMENTS)
    assert set(SETTINGS) | NOT_SETTINGS == fields
    config_hints = typing.get_type_hints(TrainConfig)
    fit_hints = typing.get_type_hints(FitSettings)
    for name in typed:
        missing = _union(config_hints[name]) - _union(fit_hints[name])
        assert not missing, f"FitSettings[{name!r}] does not take {missing}"
    keywords = [p.name for p in inspect.signature(fit).parameters.values()
                if p.kind is inspect.Parameter.KEYWORD_ONLY]
    for name in keywords:  # loss, metrics, optimizer...: a field, or fit-only
        assert name in fields or name in FIT_ONLY, name


def test_every_fit_setting_is_a_cli_flag_or_documented_fit_only() -> None:
    from torchgpu.cli.train_flags import _parser

    dests = {action.dest for action in _parser()._actions}
    keywords = [p.name for p in inspect.signature(fit).parameters.values()
                if p.kind is inspect.Parameter.KEYWORD_ONLY]
    for name in [*typing.get_type_hints(FitSettings), *keywords]:
        assert name in dests or name in FIT_ONLY, f"fit's {name!r} is no `torchgpu train` flag"
    for name in FIT_ONLY:
        assert name not in dests and name in keywords
        assert name in (fit.__doc__ or "")


@pytest.mark.parametrize(("settings", "words"), [
    ({"epoch": 3}, ["'epoch' (did you mean 'epochs'?)", "batch_size"]),
    ({"batchsize": 3, "evaldata": None},
     ["'batchsize' (did you mean 'batch_size'?)", "'evaldata' (did you mean 'eval_data'?)"]),
    ({"xyzzy": 1}, ["'xyzzy'", "the `torchgpu train` flags' names"]),
])
def test_an_unknown_setting_names_the_closest(tmp_path: Path, settings: dict[str, object],
                                              words: list[str]) -> None:
    with pytest.raises(UsageError) as info:
        fit(nn.Linear(2, 1), [], out=tmp_path / "run", **settings)  # type: ignore[arg-type]
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message
    assert not (tmp_path / "run").exists()


# checked by the session's one mypy run (tests/conftest.py: mypy_report)
MYPY_SNIPPETS = {"snippet.py": """\
from torch import nn
from torchgpu import fit

fit(nn.Linear(2, 1), [], epochs=3, batch_size="auto", lr=1e-3, resume=True, out=None)
fit(nn.Linear(2, 1), [], epoch=3)
fit(nn.Linear(2, 1), [], epochs="3")
fit(nn.Linear(2, 1), [], batch_size="big")
"""}


def test_mypy_refuses_a_misspelt_or_mistyped_setting(mypy_report: dict[str, list[str]]) -> None:
    errors = [line for line in mypy_report["snippet.py"] if ": error:" in line]
    assert [line.split(":")[1] for line in errors] == ["5", "6", "7"], "\n".join(mypy_report[""])
    assert 'Unexpected keyword argument "epoch" for "fit"' in errors[0]
    assert '"epochs"' in errors[1] and '"batch_size"' in errors[2]
