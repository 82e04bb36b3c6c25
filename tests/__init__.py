"""The test suite. Its shared helpers are the package :mod:`tests.support`."""

import pytest

# pytest rewrites the asserts of test modules and conftests only: the helpers' too, so that a
# failing assert in a helper shows its values.
pytest.register_assert_rewrite("tests.support")
