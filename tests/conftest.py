"""Tells tests/shared_launch.py which modules have a test selected in this session (and
which a test marked slow), so its shared launches run only their jobs."""

import pytest

from tests import shared_launch


@pytest.hookimpl(trylast=True)  # after -k / -m deselected what they deselect
def pytest_collection_modifyitems(items):
    modules = [item for item in items if getattr(item, "module", None) is not None]
    shared_launch.select({item.module.__name__ for item in modules},
                         {item.module.__name__ for item in modules
                          if item.get_closest_marker("slow") is not None})
