"""Every verb parses its flags before it imports the engine: a mistyped flag, a value
argparse refuses, a missing argument and ``--help`` answer without importing torch.

Each verb's cases run in one child process (bounded) that calls the CLI's ``main`` for
each, one after another, and reports after each whether ``torch`` is in ``sys.modules``
(a module, once imported, stays there: the first case that imported it is named). The
refusals must stay argparse's one paragraph, exit 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import test_env
from torchgpu.cli.main import VERBS

CHILD = """
import contextlib, io, json, sys
from torchgpu.cli.main import main
report = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exit:
            code = exit.code
    report.append({"argv": argv, "code": code, "stderr": err.getvalue(),
                   "torch": "torch" in sys.modules})
print(json.dumps(report))
"""

#: Per verb: argv lists that argparse refuses (exit 2); each verb's --help is added.
REFUSED: dict[str, list[list[str]]] = {
    "devices": [["--bogus"], ["--watch", "x"]],
    "select": [["--bogus"], ["-n", "x"]],
    "env": [["--bogus"]],
    "doctor": [["--bogus"], ["--model"]],
    "train": [["--bogus"], ["--example", "housing", "--epohcs", "3"], ["--epochs", "x"],
              ["--batch-size", "x"], ["--chunks", "0x"], ["--num-workers", "many"],
              ["--lr", "fast"]],
    "launch": [["--bogus", "script.py"], [], ["--nproc", "x", "script.py"]],
    "bench": [[], ["matmul", "--bogus"], ["matmul", "--threads", "0"]],
    "ckpt": [[], ["inspect"], ["inspect", "state.pt", "--bogus"], ["convert", "a.pt"]],
    "plan": [["--bogus"], ["--example", "gpt"], ["--batch-size", "x"]],
}


def test_every_verb_has_cases() -> None:
    assert set(REFUSED) == set(VERBS)


def _run(verb: str, cwd: Path) -> list[dict[str, object]]:
    cases = [[verb, *argv] for argv in REFUSED[verb]] + [[verb, "--help"]]
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cases)],
                          capture_output=True, text=True, timeout=120, env=test_env(),
                          cwd=cwd, check=False)
    assert done.returncode == 0, done.stderr
    report: list[dict[str, object]] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


@pytest.mark.parametrize("verb", list(REFUSED))
def test_refusals_and_help_do_not_import_torch(verb: str, tmp_path: Path) -> None:
    report = _run(verb, tmp_path)  # in tmp_path: a case that ran anyway writes there
    imported = [case["argv"] for case in report if case["torch"]]
    assert not imported, f"torch was imported by the first of {imported}"
    *refused, help_case = report
    assert help_case["code"] == 0, help_case
    for case in refused:
        message = str(case["stderr"])
        assert case["code"] == 2, case
        # argparse's one paragraph, as before: the verb, what is wrong, where to look
        assert message.startswith(f"torchgpu {verb}") and message.count("\n") == 1, case
        assert message.endswith("for the accepted flags.\n"), case
