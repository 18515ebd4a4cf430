"""The loss plot (``loss.png``), drawn here or by a helper process started during the run.

Drawing it costs ~0.45 s of CPU on a small machine, most of it once per process:
importing matplotlib (~0.3 s) and building the mathtext parser that the log axis' tick
labels need (~0.15 s); the drawing itself is ~0.1 s. That is a tenth of a 200-epoch
``make demo``. So a run that will still train for a while (:data:`MIN_OVERLAP_S`, judged
after its first epoch) starts a :class:`PlotWorker`: a Python process without torch that
imports matplotlib and draws a throw-away figure of the same kind on another CPU core
while training goes on, then waits for the run's losses on its stdin. At the end the run
sends them, and the worker writes the PNG.

Both ways draw with :func:`render`, so the file is the same. The worker is not used when
this process has already imported matplotlib (a user's style settings may apply here and
not there) or has a single CPU to run on (it would compete with training). Any failure of
the worker (it could not start, crashed, timed out, answered with an error) falls back to
drawing here, which raises what drawing raises. This module imports nothing heavy: the
worker imports it without torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO

MIN_OVERLAP_S = 1.0  # training time left that hides the worker's ~0.45 s start-up
WAIT_S = 120.0  # the longest the run waits for the worker's answer before drawing itself
_ROOT = str(Path(__file__).resolve().parent.parent.parent)  # the directory holding torchgpu


def render(path: Path | IO[bytes], xs: Sequence[int], train: Sequence[float],
           test: Sequence[float], title: str) -> None:
    """Save a PNG of train and test loss per epoch (matplotlib's Agg canvas; no pyplot,
    so no global figure state and no GUI backend). Log scale when every loss is positive
    and there are several epochs."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, 4.0), dpi=100)
    FigureCanvasAgg(figure)
    axis = figure.add_subplot()
    axis.plot(xs, train, marker="o", markersize=3, label="train")
    axis.plot(xs, test, marker="s", markersize=3, label="test")
    axis.set_xlabel("epoch")
    axis.set_ylabel("loss")
    positive = all(a > 0 and b > 0 for a, b in zip(train, test, strict=True))
    if positive and len(xs) > 1:
        axis.set_yscale("log")
    axis.set_title(title)
    axis.grid(True, alpha=0.3)
    axis.legend()
    figure.tight_layout()
    # Laid out now: without this savefig runs a second, layout-only drawing pass for the
    # placeholder engine tight_layout leaves behind (~20% of the drawing; same pixels).
    figure.set_layout_engine(None)
    figure.savefig(path)


def worth_a_worker(seconds_left: float) -> bool:
    """Whether a :class:`PlotWorker` would save time: enough training left to hide its
    start-up, matplotlib not imported here yet, and a second CPU for it (POSIX: the
    worker's answer is waited for with ``select`` on a pipe)."""
    if seconds_left < MIN_OVERLAP_S or "matplotlib" in sys.modules or os.name != "posix":
        return False
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return cpus >= 2


class PlotWorker:
    """A helper process that prepares matplotlib while the run trains, then draws
    ``loss.png`` once (:meth:`render`). :meth:`close` ends it if it was not used."""

    def __init__(self, process: subprocess.Popen[bytes] | None) -> None:
        self._process = process

    @classmethod
    def start(cls) -> PlotWorker:
        """Start the process (a worker that could not start renders nothing: the run
        then draws the plot itself)."""
        command = [sys.executable, "-c",
                   "import sys; sys.path.insert(0, sys.argv[1]); "
                   "from torchgpu.train.loss_plot import serve; serve()", _ROOT]
        try:
            process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=subprocess.DEVNULL)
        except OSError:
            process = None
        return cls(process)

    def render(self, path: Path, xs: Sequence[int], train: Sequence[float],
               test: Sequence[float], title: str) -> bool:
        """Have the worker draw the plot; True when it wrote ``path``. The worker ends
        either way. False (the caller draws it) when the worker failed, or when this
        process imported matplotlib since the worker started."""
        process, self._process = self._process, None
        if process is None:
            return False
        if "matplotlib" in sys.modules:
            _end(process)
            return False
        request = json.dumps({"path": str(path), "xs": list(xs), "train": list(train),
                              "test": list(test), "title": title})
        answer = b""
        try:
            assert process.stdin is not None and process.stdout is not None
            process.stdin.write((request + "\n").encode())
            process.stdin.close()
            # The answer line, not the process's exit: the worker answers as soon as
            # the file is written and then leaves without tearing matplotlib down.
            if select.select([process.stdout], [], [], WAIT_S)[0]:
                answer = process.stdout.readline()
        except (OSError, ValueError):
            pass
        _end(process, grace_s=1.0)
        return answer.strip() == b"ok"

    def close(self) -> None:
        """End the worker if it is still running (the run failed or was stopped)."""
        process, self._process = self._process, None
        if process is not None:
            _end(process)


def _end(process: subprocess.Popen[bytes], grace_s: float = 0.0) -> None:
    """Reap ``process``, killing it unless it exits within ``grace_s``."""
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    for stream in (process.stdin, process.stdout):
        if stream is not None:
            stream.close()


def _warm_up() -> None:
    """Import matplotlib and save a figure like the real one (log axis over several
    decades, markers, legend, title) into memory, so fonts, the mathtext parser, the
    usual tick labels and the PNG writer are all loaded before the request."""
    import io

    decades = [10.0**k for k in range(-3, 5)]
    render(io.BytesIO(), list(range(1, len(decades) + 1)), decades,
           [2 * v for v in decades], "warm-up")


def serve() -> None:
    """The worker's side: warm up, read one request line from stdin, draw it, answer
    ``ok`` (or ``error ...``) on stdout. EOF without a request ends it quietly."""
    with contextlib.suppress(Exception):  # the request's own drawing reports the error
        _warm_up()
    line = sys.stdin.readline()
    if not line.strip():
        return
    try:
        request = json.loads(line)
        render(Path(request["path"]), request["xs"], request["train"], request["test"],
               request["title"])
    except Exception as error:  # the run draws it again and raises
        answer, code = f"error {error!r}\n", 1
    else:
        answer, code = "ok\n", 0
    sys.stdout.write(answer)
    sys.stdout.flush()
    os._exit(code)  # the file is written and closed: skip tearing matplotlib down
