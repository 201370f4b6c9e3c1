import doctest
import importlib
import importlib.util
import pkgutil

import pytest

import vagent

# Every module with a docstring example; the examples are part of the documentation, so they must hold.
MODULES = [
    m.name
    for m in pkgutil.walk_packages(vagent.__path__, "vagent.")
    if ">>>" in (importlib.util.find_spec(m.name).loader.get_source(m.name) or "")
]


def test_the_examples_are_found():
    assert {"vagent.geometry", "vagent.media", "vagent.chat", "vagent.toolbox"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_hold(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 and result.failed == 0
