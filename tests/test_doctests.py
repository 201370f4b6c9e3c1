import doctest

import pytest

import vagent.geometry
import vagent.media


@pytest.mark.parametrize("module", [vagent.geometry, vagent.media])
def test_docstring_examples_hold(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
