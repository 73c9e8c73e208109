"""Tells tests/shared_launch.py which modules have a test selected in this session (and
which a test marked slow), so its shared launches run only their jobs, and how to stop the
running test's pytest-timeout timer while a shared launch runs in it (the launch's own
timeout covers the launch; tests/shared_launch.py, "Time limits")."""

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
