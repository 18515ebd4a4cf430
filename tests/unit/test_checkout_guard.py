"""The suite's checkout guard (tests/conftest.py) lets pytest's own report files through:
the GPU kit runs the GPU tests with ``--junitxml`` inside the checkout."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tests import conftest

REPO = conftest.REPO


def _config(**options: Any) -> Any:
    return SimpleNamespace(option=SimpleNamespace(**options))


def test_the_junit_report_named_on_the_command_line_is_not_a_stray_write() -> None:
    xml = REPO / "benchmarks" / "results" / "gpu-x" / "tests" / "gpu.xml"
    config = _config(xmlpath=str(xml))
    assert conftest._own_report(config, "benchmarks/results/gpu-x/tests/gpu.xml")
    assert conftest._own_report(config, "benchmarks/results/gpu-x/")  # a new folder


def test_anything_else_in_the_checkout_still_fails_the_guard(tmp_path: Path) -> None:
    config = _config(xmlpath=str(REPO / "report.xml"))
    assert not conftest._own_report(config, "runs/some-run/")
    assert not conftest._own_report(config, "report.xml.bak")
    assert not conftest._own_report(_config(), "report.xml")  # no report asked for
    outside = _config(xmlpath=str(tmp_path / "gpu.xml"))  # written outside the checkout
    assert not conftest._own_report(outside, "gpu.xml")
