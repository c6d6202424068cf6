import pytest

from engine import LLM


@pytest.fixture(scope="session")
def llm32():
    """One fp32 engine on the embedded model, shared: outputs compared across calls are exact in fp32."""
    return LLM(dtype="float32", num_kv_blocks=512)


@pytest.fixture(scope="session")
def tokenizer(llm32):
    return llm32.engine.tokenizer
