"""Measures what tests/tolerance.py's figures come from: how far apart the two sides of each
comparison are, so a tolerance is set from the spread seen across CPU kernels and rank
counts, not tuned until a run passes.

As a pytest plugin it records, into the JSON-lines file $HP_SPREAD_OUT, every
``np.testing.assert_allclose`` (``tests.tolerance.assert_close`` included) with its
largest difference relative to the largest expected value, and every number named
``*diff*`` that ranks return to the test process (the parameter differences the tests
bound). Assertions still run and fail as usual. Run a file once per kernel choice:

    ATEN_CPU_CAPABILITY=default HP_SPREAD_OUT=/tmp/spread.jsonl PYTHONPATH=tools \\
        .venv/bin/python -m pytest -q -p tolerance_spread tests/test_parity.py -k torch
    ONEDNN_MAX_CPU_ISA=SSE41 HP_SPREAD_OUT=/tmp/spread.jsonl PYTHONPATH=tools \\
        .venv/bin/python -m pytest -q -p tolerance_spread tests/test_parity.py -k mindspore

then ``python tools/tolerance_spread.py /tmp/spread.jsonl`` prints the largest value per
comparison and setting.
"""

from __future__ import annotations

import collections
import inspect
import json
import os
import re
import sys

import numpy as np

_CURRENT = {"test": ""}
_SETTING_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def _record(entry: dict) -> None:
    entry["test"] = _CURRENT["test"]
    entry["setting"] = " ".join(f"{v}={os.environ[v]}" for v in _SETTING_VARS if v in os.environ)
    with open(os.environ["HP_SPREAD_OUT"], "a", encoding="utf-8") as out:
        out.write(json.dumps(entry) + "\n")


def _recording_allclose(compare):
    def allclose(actual, desired, *args, **kwargs):
        caller = inspect.stack()[1]
        if os.path.basename(caller.filename) == "tolerance.py":
            caller = inspect.stack()[2]
        a, d = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
        scale = float(np.abs(d).max(initial=0.0))
        diff = float(np.abs(a - d).max(initial=0.0))
        _record({"where": f"{os.path.basename(caller.filename)}:{caller.lineno}",
                 "value": diff / scale if scale else diff})
        return compare(actual, desired, *args, **kwargs)
    return allclose


def _recording_launch(launch):
    def run(target, *args, **kwargs):
        per_rank = launch(target, *args, **kwargs)
        for path, value in _diffs(per_rank, target.split(":")[-1]):
            _record({"where": path, "value": value})
        return per_rank
    return run


def _diffs(value, path):
    """(path, number) for every float under a key whose name holds 'diff'."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _diffs(item, f"{path}.{key}")
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _diffs(item, path)
    elif isinstance(value, (float, np.floating)) and "diff" in path.rsplit(".", 1)[-1]:
        yield path, float(value)


def pytest_configure(config):
    np.testing.assert_allclose = _recording_allclose(np.testing.assert_allclose)


def pytest_collection_finish(session):
    for name, module in list(sys.modules.items()):
        if name.startswith("tests.") and callable(getattr(module, "run_ranks", None)):
            module.run_ranks = _recording_launch(module.run_ranks)


def pytest_runtest_setup(item):
    _CURRENT["test"] = re.sub(r"\[.*", "", item.name)


def main(path: str) -> None:
    largest = collections.defaultdict(dict)
    with open(path, encoding="utf-8") as lines:
        for entry in map(json.loads, lines):
            key = (entry["where"], entry["test"])
            largest[key][entry["setting"]] = max(largest[key].get(entry["setting"], 0.0),
                                                 entry["value"])
    for (where, test), by_setting in sorted(largest.items()):
        figures = "  ".join(f"{s or 'no cap'}: {v:.1e}" for s, v in by_setting.items())
        print(f"{where}  {test}\n    {figures}")


if __name__ == "__main__":
    main(sys.argv[1])
