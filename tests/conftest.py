"""Shared test set-up: the gpu marker skips without CUDA; tests run single-threaded
so two xdist workers share the 2-core CI machine fairly, and ``xdist_group`` marks hold
under ``--dist loadgroup``; the ``run_device`` and ``mypy_report`` fixtures."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))


# `TORCHGPU_TEST_DEVICE=cuda` re-runs the tests taking the `run_device` fixture on a GPU
# (benchmarks/gpu/kit.py does, with `-m device`); unset, they run on the CPU.
TEST_DEVICE_ENV = "TORCHGPU_TEST_DEVICE"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"device: takes the run_device fixture ({TEST_DEVICE_ENV} picks the device)"
    )
    # pytest-xdist registers it too; without xdist (-p no:xdist) --strict-markers would
    # refuse tests.procs.HEAVY
    config.addinivalue_line("markers", "xdist_group(name): run on one xdist worker")
    config.pluginmanager.register(_XdistGroups(), "torchgpu-xdist-groups")


class _XdistGroups:
    """``--dist loadgroup`` learns a test's ``xdist_group`` from a ``@name`` suffix that
    pytest-xdist's worker adds to its node id by setting ``item._nodeid``, which pytest
    9.2 no longer reads (its node ids are structured): every group was silently ignored
    and its tests spread over both workers (pytest-xdist issue 1386). Add the suffix
    through the structured id where xdist's did not take."""

    @pytest.hookimpl(trylast=True)  # after xdist's own attempt
    def pytest_collection_modifyitems(self, config: pytest.Config,
                                      items: list[pytest.Item]) -> None:
        if not getattr(config.option, "loadgroup", False):  # set on loadgroup workers only
            return
        try:
            from _pytest.nodeid import NodeId
        except ImportError:  # an older pytest: xdist's suffix takes
            return
        for item in items:
            names = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name",
                                                                              "default"))
                            for mark in item.iter_markers("xdist_group")})
            if names and "@" not in item.nodeid.rsplit("]", 1)[-1]:
                item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")  # type: ignore[attr-defined]


@pytest.fixture
def run_device() -> torch.device:
    """The device a device-sensitive test runs on: ``$TORCHGPU_TEST_DEVICE``, default cpu."""
    import torch

    spec = os.environ.get(TEST_DEVICE_ENV, "").strip() or "cpu"
    if spec.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip(f"{TEST_DEVICE_ENV}={spec} but no CUDA GPU is visible")
    return torch.device(spec)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the marker must be there by then
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    torch.set_num_threads(1)
    for item in items:
        if "run_device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.device)
        if "mypy_report" in getattr(item, "fixturenames", ()):
            # on the worker that already ran mypy for the session (see mypy_report)
            item.add_marker(pytest.mark.xdist_group("mypy"))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def mypy_report(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """``mypy --strict`` run once over the ``MYPY_SNIPPETS`` ({file name: source}) of every
    collected test module that takes this fixture, against this checkout's ``src``: each
    file name's output lines (``name:line: error: ...``), and under ``""`` the whole
    output (for failure messages). One run for all: reading torch's stubs is most of
    mypy's ~15 s. Imported modules' own errors are not reported (``--follow-imports=silent``);
    no cache is written (``--cache-dir`` /dev/null, mypy's documented way: the run is the
    session's only one, and writing the cache of torch's stubs cost ~10 % of it), never
    into the checkout."""
    import subprocess

    snippets: dict[str, str] = {}
    for item in request.session.items:
        if "mypy_report" in getattr(item, "fixturenames", ()):
            snippets.update(getattr(getattr(item, "module", None), "MYPY_SNIPPETS", {}))
    work = tmp_path_factory.mktemp("mypy")
    for name, source in snippets.items():
        (work / name).write_text(source, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent",
         "--no-error-summary", "--cache-dir", os.devnull, *sorted(snippets)],
        cwd=work, env={**os.environ, "MYPYPATH": str(SRC)}, capture_output=True, text=True,
        timeout=300, check=False)
    lines = done.stdout.splitlines()
    report = {name: [line for line in lines if line.startswith(f"{name}:")]
              for name in snippets}
    report[""] = [*lines, *done.stderr.splitlines()]
    return report


# The suite never writes into the checkout: a run (a test's `fit(out=...)` with a relative
# path, a default `runs/...`) that lands there fails the session, naming the new paths.
# Caches that tools write by design are allowed.
_ALLOWED_IN_CHECKOUT = (".venv", ".pytest_cache", ".mypy_cache", ".ruff_cache", "__pycache__",
                        ".egg-info", ".coverage", ".whl", ".gl")


def _checkout_paths() -> set[str] | None:
    """Paths git reports as new, changed or ignored in the checkout; None without git."""
    import subprocess

    try:
        done = subprocess.run(["git", "status", "--porcelain", "--ignored=matching"], cwd=REPO,
                              capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    paths = {line[3:].strip() for line in done.stdout.splitlines() if line.strip()}
    return {p for p in paths if not any(part in p for part in _ALLOWED_IN_CHECKOUT)}


def _own_report(config: pytest.Config, path: str) -> bool:
    """Whether ``path`` (as git names it: a file, or a new folder ending in "/") is or holds
    the report pytest itself was asked to write (``--junitxml``, ``--resultlog``-like
    options): the GPU kit keeps its ``--junitxml`` beside its other results."""
    for option in ("xmlpath", "reportlog"):
        wanted = getattr(config.option, option, None)
        if not wanted:
            continue
        try:
            relative = Path(wanted).resolve().relative_to(REPO.resolve()).as_posix()
        except ValueError:  # outside the checkout
            continue
        if relative == path or (path.endswith("/") and relative.startswith(path)):
            return True
    return False


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # the controller, once per session
        session.config._checkout_before = _checkout_paths()  # type: ignore[attr-defined]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    before = getattr(session.config, "_checkout_before", None)
    if before is None or hasattr(session.config, "workerinput"):
        return
    after = _checkout_paths() or set()
    landed = sorted(p for p in after - before if not _own_report(session.config, p))
    if landed:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = ("the suite wrote into the checkout (a test must write under its tmp_path): "
                   + ", ".join(landed))
        if reporter is not None:
            reporter.write_line(f"FAILED checkout guard: {message}", red=True)
        else:
            print(message, file=sys.stderr)
