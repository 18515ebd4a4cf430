"""Evaluation metrics: what a run reports as ``test_<name>`` after each epoch.

A metric is a function ``fn(output, target_or_batch) -> float``, averaged over the
evaluation samples (each batch weighted by its rows: right for means such as a per-sample
accuracy), or an object with ``reset()``, ``update(output, target_or_batch)`` and
``compute() -> float``, reset before each evaluation and computed once at its end (right for
R², F1, perplexity; torchmetrics' ``Metric`` plugs in as it is, ``compute()`` may return a
one-element tensor). ``target_or_batch`` is the target of ``(inputs, target)`` pairs, the
whole batch for dict batches. :class:`R2` and :class:`Accuracy` are built in; ``--metrics``
names them (``BUILT_IN``) or specs (``from_specs``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeGuard, runtime_checkable

from torch import Tensor

from torchgpu.errors import UsageError


@runtime_checkable
class Metric(Protocol):
    """A metric that aggregates over the whole evaluation (torchmetrics-style)."""

    def reset(self) -> None: ...

    def update(self, output: Any, target: Any) -> Any: ...

    def compute(self) -> Any: ...


MetricFn = Callable[[Any, Any], float]
#: What a Task's ``metrics`` maps names to: a per-batch function or a :class:`Metric`.
MetricLike = Metric | MetricFn


def aggregates(metric: object) -> TypeGuard[Metric]:
    """True when ``metric`` is an object with ``reset``/``update``/``compute`` (checked
    before callability: a torchmetrics Metric is callable too)."""
    return all(callable(getattr(metric, name, None)) for name in ("reset", "update", "compute"))


def check_metrics(metrics: Mapping[Any, Any] | None) -> dict[str, MetricLike]:
    """``metrics`` as a plain dict, each entry checked.

    Raises UsageError for ``metrics`` that is not a mapping (a list of metrics has no
    names to report them by), and naming the entry and the fix for a name that is not a non-empty
    string, the name ``loss`` (its ``test_loss`` would overwrite the run's loss), and a
    value that is neither a function nor an object with reset/update/compute.
    """
    if metrics is not None and not isinstance(metrics, Mapping):
        shown = repr(metrics)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise UsageError(
            f"metrics={shown} is a {type(metrics).__name__}, not a dict: pass "
            "{name: metric}, e.g. metrics={'accuracy': fn}, each reported as test_<name>, "
            "where a metric is a function fn(output, target_or_batch) -> float or an object "
            "with reset(), update(output, target) and compute() -> float"
        )
    checked: dict[str, MetricLike] = {}
    for name, metric in (metrics or {}).items():
        if not isinstance(name, str) or not name:
            raise UsageError(
                f"metrics: the name {name!r} is not a non-empty string: name each metric, "
                "e.g. metrics={'accuracy': fn}; it is reported as test_<name>"
            )
        if name == "loss":
            raise UsageError(
                "metrics: a metric named 'loss' would be reported as test_loss, which is the "
                "run's own evaluation loss: give it another name, e.g. 'my_loss'"
            )
        if not (aggregates(metric) or callable(metric)):
            raise UsageError(
                f"metrics[{name!r}] is a {type(metric).__name__}: pass a function "
                "fn(output, target_or_batch) -> float (averaged over the evaluation samples) "
                "or an object with reset(), update(output, target) and compute() -> float "
                "(e.g. a torchmetrics Metric)"
            )
        checked[name] = metric
    return checked


def _number(value: Any, name: str) -> float:
    """``compute()``'s or a function's result as a float (a one-element tensor too)."""
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise UsageError(
                f"metric {name!r} returned a tensor of shape {tuple(value.shape)}: a metric "
                "gives one number per evaluation; reduce it (e.g. .mean())"
            )
        return float(value.item())
    return float(value)


class Tally:
    """One evaluation's metrics: reset on creation, :meth:`update` per batch, then
    :meth:`results`. Functions are summed weighted by rows; objects are updated."""

    def __init__(self, metrics: Mapping[str, MetricLike] | None) -> None:
        self._objects: dict[str, Metric] = {}
        self._functions: dict[str, MetricFn] = {}
        for name, metric in (metrics or {}).items():
            if aggregates(metric):
                metric.reset()
                self._objects[name] = metric
            elif callable(metric):  # checked by check_metrics: a function otherwise
                self._functions[name] = metric
        self._names = list(metrics or {})
        self._sums = dict.fromkeys(self._functions, 0.0)
        self._count = 0

    def update(self, output: Any, target: Any, rows: int) -> None:
        """One batch of ``rows`` samples: its output and its target (or the dict batch)."""
        self._count += rows
        for name, fn in self._functions.items():
            self._sums[name] += _number(fn(output, target), name) * rows
        for metric in self._objects.values():
            metric.update(output, target)

    def results(self) -> dict[str, float]:
        """Every metric by name; NaN for all of them when no sample was seen."""
        if self._count == 0:
            return dict.fromkeys(self._names, math.nan)
        return {name: self._sums[name] / self._count if name in self._sums
                else _number(self._objects[name].compute(), name) for name in self._names}


class R2:
    """The coefficient of determination over the whole evaluation split,
    ``1 - SSE / SST`` with ``SST = sum(y²) - sum(y)² / n``, from float64 sums (NaN when the
    targets do not vary). The output and target must hold the same number of values; the
    target is reshaped to the output's shape."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.sse = self.sum_y = self.sum_y2 = 0.0
        self.count = 0

    def update(self, output: Tensor, target: Tensor) -> None:
        target = target.double().reshape(output.shape)
        self.sse += float(((output.double() - target) ** 2).sum())
        self.sum_y += float(target.sum())
        self.sum_y2 += float((target**2).sum())
        self.count += int(target.shape[0])

    def compute(self) -> float:
        if self.count == 0:
            return math.nan
        total = self.sum_y2 - self.sum_y * self.sum_y / self.count
        return 1.0 - self.sse / total if total > 0 else math.nan


class Accuracy:
    """The share of samples whose highest-scoring class (``output.argmax(dim=1)``) is the
    target class index, over the whole evaluation split."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.correct = 0
        self.count = 0

    def update(self, output: Tensor, target: Tensor) -> None:
        self.correct += int((output.argmax(dim=1) == target).sum())
        self.count += int(target.shape[0])

    def compute(self) -> float:
        return self.correct / self.count if self.count else math.nan


#: The metrics ``--metrics`` knows by name (a class each: one fresh object per run).
BUILT_IN: dict[str, type[Metric]] = {"r2": R2, "accuracy": Accuracy}


def spec_items(text: str) -> list[str]:
    """The comma-separated items of ``--metrics``, stripped."""
    return [item.strip() for item in text.split(",")]


def check_specs(text: str) -> None:
    """UsageError, before anything is loaded, for a ``--metrics`` item that is neither a
    built-in name (:data:`BUILT_IN`) nor a ``module:function`` / ``file.py:function`` spec."""
    for item in spec_items(text):
        if item not in BUILT_IN and ":" not in item.strip(":"):
            raise UsageError(
                f"--metrics {text!r}: {item!r} is neither a built-in metric "
                f"({', '.join(BUILT_IN)}) nor a spec: write module.path:function or "
                "path/to/file.py:function, comma-separated, e.g. --metrics r2,my_metrics.py:mae."
            )


def from_specs(text: str) -> dict[str, MetricLike]:
    """``--metrics`` as ``{name: metric}``: a built-in name gives its class's object; a
    spec its attribute (a class is instantiated), named by the attribute (``file.py:mae``
    is ``test_mae``). UsageError naming the item for one that does not resolve, is not a
    metric, or repeats a name."""
    check_specs(text)
    from torchgpu.factories import resolve_spec

    found: dict[str, MetricLike] = {}
    for item in spec_items(text):
        value: Any
        if item in BUILT_IN:
            name, value = item, BUILT_IN[item]()
        else:
            name = item.rpartition(":")[2].rsplit(".", 1)[-1]
            value = resolve_spec(item, "metrics")
            if isinstance(value, type):
                try:
                    value = value()
                except Exception as error:
                    raise UsageError(
                        f"--metrics {item}: {name}() failed: {error}. A metric class must "
                        "build with no arguments; wrap it in a function that builds it."
                    ) from error
        if not (aggregates(value) or callable(value)):
            raise UsageError(
                f"--metrics {item}: {name} is a {type(value).__name__}: name a function "
                "fn(output, target_or_batch) -> float (averaged over the evaluation samples) "
                "or a class with reset(), update(output, target) and compute() -> float."
            )
        if name in found or name == "loss":
            why = ("is the run's own evaluation loss (test_loss)" if name == "loss"
                   else "is named twice")
            raise UsageError(
                f"--metrics {text!r}: the metric name {name!r} {why}; each metric is "
                "written as test_<name>, so give the function another name.")
        found[name] = value
    return found
