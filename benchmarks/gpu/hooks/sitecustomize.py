"""Imported at start-up by every Python process a GPU-check step starts (the kit puts this
directory on their PYTHONPATH): SIGUSR1 then prints every thread's stack to stderr, which
is the step's log. The kit sends it to a step that ran past its budget, just before it
stops it, so a hang says where it hung. Then any other ``sitecustomize`` on the path runs,
as it would have without this one.
"""

from __future__ import annotations

import faulthandler
import importlib.machinery
import importlib.util
import os
import signal
import sys

if hasattr(signal, "SIGUSR1"):
    faulthandler.register(signal.SIGUSR1, all_threads=True)

_HERE = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
