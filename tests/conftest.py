"""Tells tests/shared_launch.py which modules have a test selected in this session (and
which a test marked slow), so its shared launches run only their jobs, and how to stop the
running test's pytest-timeout timer while a shared launch runs in it (the launch's own
timeout covers the launch; tests/shared_launch.py, "Time limits"); and the one-process
runs of examples/train_lm.py that its parallel runs are held against, once per session."""

import contextlib

import pytest

from tests import shared_launch


@pytest.hookimpl(trylast=True)  # after -k / -m deselected what they deselect
def pytest_collection_modifyitems(items):
    modules = [item for item in items if getattr(item, "module", None) is not None]
    shared_launch.select({item.module.__name__ for item in modules},
                         {item.module.__name__ for item in modules
                          if item.get_closest_marker("slow") is not None})


@pytest.hookimpl(optionalhook=True, tryfirst=True)  # returns None: pytest-timeout still sets it
def pytest_timeout_set_timer(item, settings):
    @contextlib.contextmanager
    def stopped():
        item.config.hook.pytest_timeout_cancel_timer(item=item)
        try:
            yield
        finally:
            item.config.hook.pytest_timeout_set_timer(item=item, settings=settings)

    shared_launch.set_test_timer(stopped)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_cancel_timer(item):
    shared_launch.set_test_timer(None)


@pytest.fixture(scope="session")
def train_lm_references(tmp_path_factory):
    """examples/train_lm.py in one process on each framework (tests/test_train_lm.py's tiny
    command line, 5 steps, the weights exported): ``{backend: (metrics, stdout),
    "exports": {backend: directory}}``, the reference of tests/test_train_lm_tp.py,
    test_train_lm_cp.py and test_train_lm_pp.py, run once for all three."""
    from tests.test_train_lm import _train

    root = tmp_path_factory.mktemp("train_lm_references")
    runs = {backend: _train(root / backend, backend, "--nproc", "1", "--steps", "5",
                            "--export", str(root / f"{backend}_export"))
            for backend in ("torch", "mindspore")}
    return {**runs, "exports": {backend: root / f"{backend}_export" for backend in runs}}
