import pytest

from tests.engine.helpers import hf_verdicts


@pytest.fixture(autouse=True, scope="module")
def forget_hf_verdicts():
    """The cache of HF's verdicts holds its HF models: a module's models go with the module."""
    yield
    hf_verdicts.cache_clear()
