import functools
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a missing local model fails fast instead of hanging on the hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not os.path.exists("/dev/nvidiactl"):  # no GPU: the Triton kernels run under triton's interpreter, on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel is defined, so before any engine import

import subprocess
import time
import weakref

import pytest

from tests.fixtures.triton_interpreter import interpreter_overflow_checks

LIVE_ENGINES: "weakref.WeakSet" = weakref.WeakSet()


def nproc() -> int:
    """The usable cores as coreutils counts them (affinity included): a reference outside the code under test."""
    return int(subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout)


def pytest_collection_modifyitems(config, items):
    """`gpu` cases are deselected, not passed, on machines without CUDA: the summary counts them apart."""
    if os.path.exists("/dev/nvidiactl"):
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]


@pytest.fixture(autouse=True, scope="session")
def _interpreter_without_overflow_checks():
    interpreter_overflow_checks(False)
    yield


@pytest.fixture(autouse=True, scope="session")
def _track_engines():
    try:
        from engine.llm_engine import LLMEngine
    except ImportError:  # pure unit runs without torch still work
        yield
        return
    from engine.core_client import ProcessCore

    originals = {cls: cls.__init__ for cls in (LLMEngine, ProcessCore)}  # a core process is checked through its stats

    def tracking(original):
        @functools.wraps(original)
        def tracking_init(self, *args, **kwargs):
            original(self, *args, **kwargs)
            LIVE_ENGINES.add(self)
        return tracking_init

    for cls, original in originals.items():
        cls.__init__ = tracking(original)
    yield
    for cls, original in originals.items():
        cls.__init__ = original


@pytest.fixture(autouse=True)
def all_kv_blocks_free_after_test():
    """Every engine test ends with no request in flight and every KV block back in the pool."""
    yield
    deadline = time.monotonic() + 10
    for engine in list(LIVE_ENGINES):
        if getattr(engine, "dead_reason", None) is not None or getattr(engine, "_closing", False):
            continue  # a core process killed or shut down by its test has no blocks left to hold
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.02)
        stats = engine.stats()
        assert stats.idle, stats


@pytest.fixture(scope="session")
def llm32():
    """One fp32 engine on the embedded model, shared: outputs compared across calls are exact in fp32."""
    from engine import LLM

    return LLM(dtype="float32", num_kv_blocks=512)


@pytest.fixture(scope="session")
def tokenizer(llm32):
    return llm32.inputs.tokenizer
