"""The engine cores keep one interface: AsyncLLMEngine and the offline LLM call each through EngineCore, so a method
one of them lacks, or takes differently, would only fail at run time in the mode that has it."""
import inspect

import pytest

from engine.core_client import ProcessCore
from engine.core_inline import InlineCore
from engine.core_protocol import EngineCore
from engine.core_thread import ThreadCore

CORES = [InlineCore, ThreadCore, ProcessCore]

METHODS = [name for name, member in vars(EngineCore).items() if inspect.isfunction(member) and not name.startswith("_")]


@pytest.mark.parametrize("core", CORES)
def test_each_core_implements_every_method_of_the_protocol_with_its_signature(core):
    assert len(METHODS) >= 9
    for name in METHODS:
        assert inspect.signature(getattr(core, name)) == inspect.signature(getattr(EngineCore, name)), name
    assert list(inspect.signature(inspect.unwrap(core.__init__)).parameters) == ["self", "config", "deliver", "on_death"]


@pytest.mark.parametrize("core", CORES)
def test_each_core_sets_the_protocols_attributes(core):
    source = "".join(inspect.getsource(inspect.unwrap(cls.__init__)) for cls in core.__mro__[:-1] if "__init__" in vars(cls))
    for attribute in EngineCore.__annotations__:
        assert f"self.{attribute}" in source, attribute
