import pytest

from tests.fixtures.triton_interpreter import interpreter_overflow_checks


def pytest_collection_modifyitems(items):
    """Under triton's interpreter a kernel's arithmetic is numpy's: a NaN or inf made anywhere (a lane read from
    memory no one wrote, an exp of -inf - -inf) warns. Made an error here, so a kernel that computes garbage even in
    lanes it then masks off fails its test instead of passing with a warning (the split decode's merge did)."""
    for item in items:
        if "tests/engine/kernels/" in str(item.fspath):
            item.add_marker(pytest.mark.filterwarnings("error::RuntimeWarning"))


@pytest.fixture(autouse=True)
def _overflow_checks_on():
    """Triton's interpreter checks each int32 add and multiply of a kernel for overflow here (the rest of the suite
    goes without, see tests/conftest.py)."""
    interpreter_overflow_checks(True)
    yield
    interpreter_overflow_checks(False)
