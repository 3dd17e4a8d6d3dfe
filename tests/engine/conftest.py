"""The engine tests' torch on one thread per module (tests/support.py says why; under xdist
tests/conftest.py already does it for the whole worker, this covers `-n 0` runs too)."""

import pytest
from support import one_thread


@pytest.fixture(scope="module", autouse=True)
def _threads():
    with one_thread():
        yield
