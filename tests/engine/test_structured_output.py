"""Structured output in the engine (fp32): schema-valid JSON, forced tool calls, compile errors as input errors,
and batch mates untouched."""
import json
import re

import pytest

from engine import EngineInputError, SamplingParams, StructuredOutput, tool_calls
from engine.structured_output import GrammarChecker, GrammarCompiler

pytestmark = pytest.mark.slow
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}}}
ASK = [{"role": "user", "content": "Invent a person."}]
PLAIN = [{"role": "user", "content": "Describe the sea."}]


def test_schema_output_parses_and_leaves_batch_mates_alone(llm32):
    plain = SamplingParams(max_tokens=24, temperature=0.0)
    constrained = SamplingParams(max_tokens=60, temperature=0.0, structured_output=StructuredOutput(json_schema=PERSON))
    (alone,) = llm32.chat([PLAIN], plain, use_tqdm=False)
    person, mate = llm32.chat([ASK, PLAIN], [constrained, plain], use_tqdm=False)
    value = json.loads(person.text)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int) and person.finish_reason == "stop"
    assert mate.token_ids == alone.token_ids
    stats = llm32.engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_sampled_output_keeps_to_the_schema_too(llm32):
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=s, structured_output=StructuredOutput(json_schema=PERSON))
              for s in range(4)]
    for out in llm32.chat([ASK] * 4, params, use_tqdm=False):
        if out.finish_reason == "stop":
            assert set(json.loads(out.text)) == {"name", "age"}
        else:
            assert out.text.startswith('{"name": "')


@pytest.mark.parametrize("pattern,between", [("\n", "\n"), ("", ""), ("[ ]?", " ")])
def test_a_whitespace_pattern_sets_the_whitespace_around_jsons_punctuation(llm32, pattern, between):
    """vLLM's whitespace_pattern (outlines' reading): the whitespace JSON may hold around its punctuation. Greedy
    output, so each reply is the model's most likely JSON within the pattern: it parses, and any whitespace outside
    its strings is the pattern's."""
    spec = StructuredOutput(json_schema=PERSON, whitespace_pattern=pattern)
    (out,) = llm32.chat([ASK], SamplingParams(max_tokens=60, temperature=0.0, structured_output=spec), use_tqdm=False)
    value = json.loads(out.text)
    assert set(value) == {"name", "age"} and out.finish_reason == "stop", out.text
    outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', out.text)
    assert set(re.findall(r"\s", outside_strings)) <= set(between) and between in outside_strings, out.text
    if pattern == "":
        assert out.text == json.dumps(value, separators=(",", ":"))


@pytest.mark.parametrize("spec,param", [
    (dict(json_schema=PERSON, whitespace_pattern="(", whitespace_param="structured_outputs.whitespace_pattern"),
     "structured_outputs.whitespace_pattern"),
    (dict(regex="[a-z]+", whitespace_pattern=" ", whitespace_param="guided_whitespace_pattern"),
     "guided_whitespace_pattern"),
    (dict(json_object=True, whitespace_pattern="x" * 300), "whitespace_pattern"),
])
def test_a_whitespace_pattern_that_cannot_apply_is_refused_by_its_own_field(llm32, spec, param):
    with pytest.raises(EngineInputError) as refused:
        llm32.add_request("bad-whitespace", "hi", SamplingParams(structured_output=StructuredOutput(**spec)))
    assert refused.value.param == param


@pytest.mark.parametrize("fmt", tool_calls.FORMATS)
def test_a_forced_tool_call_has_arguments_valid_for_its_function(llm32, fmt):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
        "additionalProperties": False}}}]
    params = SamplingParams(max_tokens=40, temperature=0.0,
                            structured_output=StructuredOutput(grammar=tool_calls.grammar(tools, "add", fmt=fmt)))
    (out,) = llm32.chat([[{"role": "user", "content": "What is 2 plus 3?"}]], params, use_tqdm=False)
    _, (call,) = tool_calls.parse(out.text, fmt)
    assert call.name == "add" and set(json.loads(call.arguments)) == {"a", "b"}
    if fmt == "llama3_json":
        assert out.text.startswith('{"name": "add", "parameters": {')


EMAIL = r"[a-z]{1,8}@[a-z]{1,8}\.com"
SQL_GBNF = """root ::= "SELECT " column " FROM " table
column ::= "name" | "age"
table ::= "people" | "pets"
"""


@pytest.mark.parametrize("spec,fits", [
    (StructuredOutput(regex=EMAIL), lambda text: re.fullmatch(EMAIL, text)),
    (StructuredOutput(choice=("positive", "negative")), lambda text: text in ("positive", "negative")),
    (StructuredOutput(grammar=SQL_GBNF), lambda text: re.fullmatch(r"SELECT (name|age) FROM (people|pets)", text)),
], ids=["regex", "choice", "gbnf"])
def test_a_regex_a_choice_and_a_gbnf_grammar_bound_the_whole_output(llm32, spec, fits):
    params = SamplingParams(max_tokens=30, temperature=0.0, structured_output=spec)
    (out,) = llm32.chat([[{"role": "user", "content": "Write an email address, then a review of a film."}]], params,
                        use_tqdm=False)
    assert out.finish_reason == "stop" and fits(out.text), out.text


def test_a_complete_structure_ends_the_output_before_min_tokens(llm32):
    """min_tokens holds off EOS, yet a structure that is complete allows nothing but EOS: the reply ends there, whole
    and with "stop", rather than failing for want of a token or running past its constraint (README's table)."""
    params = SamplingParams(max_tokens=30, min_tokens=20, temperature=0.0,
                            structured_output=StructuredOutput(choice=("positive", "negative")))
    (out,) = llm32.chat([[{"role": "user", "content": "Review a film in one word."}]], params, use_tqdm=False)
    assert out.finish_reason == "stop" and out.error is None and out.text in ("positive", "negative"), out
    assert len(out.token_ids) < params.min_tokens


def test_a_schema_that_cannot_compile_is_an_input_error_and_compiles_are_cached(llm32):
    with pytest.raises(EngineInputError, match="response_format"):
        llm32.add_request("bad-schema", "hi", SamplingParams(
            structured_output=StructuredOutput(json_schema={"type": "nonsense"})))
    compiler = llm32.engine.grammars
    before = len(compiler._cache)
    for _ in range(2):
        compiler.matcher(StructuredOutput(json_schema={"type": "object", "properties": {"x": {"type": "integer"}}}))
    assert len(compiler._cache) == before + 1


def test_a_constraint_past_the_lexers_limits_fails_every_request_that_sends_it_by_name(llm32):
    """The first copy of the template meets the lexer's limit at its second token; the next copy, sharing the
    template's lexer, at its first, where its mask allows only EOS: that is a failure too, not a complete output."""
    huge = SamplingParams(max_tokens=3, temperature=0.0, structured_output=StructuredOutput(regex="a{1000000000}"))
    for _ in range(3):
        out = llm32.generate(["hi"], huge, use_tqdm=False)[0]
        assert out.finish_reason == "abort" and out.error_param == "response_format", out
        assert "parser limits" in out.error
        assert not llm32.engine.grammars.is_compiled(huge.structured_output), "the next request compiles it afresh"
    fits = SamplingParams(max_tokens=3, temperature=0.0, structured_output=StructuredOutput(regex="a{300}"))
    assert llm32.generate(["hi"], fits, use_tqdm=False)[0].finish_reason == "length"


CHECKED_SPECS = [
    StructuredOutput(json_schema={"type": "object", "properties": {"x": {"type": "integer"}}}),
    StructuredOutput(json_schema={"type": "nonsense"}),
    StructuredOutput(json_schema={"type": "string", "pattern": "[a-z"}),
    StructuredOutput(json_schema={"enum": [f"value{i}" for i in range(120_000)]}),  # past the initial lexer fuel
    StructuredOutput(json_schema={"type": "string", "pattern": "(a|b)*a(a|b){25}"}),  # a lexer state blow-up
    StructuredOutput(grammar='start: "yes" | "no"'),
    StructuredOutput(grammar="start: undefined_rule"),
    StructuredOutput(grammar=SQL_GBNF),
    StructuredOutput(grammar='root ::= "a" | ('),
    StructuredOutput(regex="[a-z"),
    StructuredOutput(choice=("yes", 'say "no"\n')),
]


@pytest.mark.parametrize("spec", CHECKED_SPECS, ids=["object", "bad-type", "bad-pattern", "too-big", "blow-up", "lark", "bad-lark", "gbnf", "bad-gbnf",
                              "bad-regex", "choice"])
def test_the_front_ends_checker_refuses_exactly_what_the_core_cannot_compile(llm32, spec):
    """Where the core runs in its own process the front end only checks a constraint (a third of a compile) and
    compiles nothing: it must refuse, with the same field, exactly the constraints the core's compile refuses."""
    checker = GrammarChecker(llm32.engine.tokenizer, llm32.engine.vocab_size)
    compiler = GrammarCompiler(llm32.engine.tokenizer, llm32.engine.vocab_size)
    outcomes = []
    for attempt in (checker.check, compiler.prepare):
        try:
            attempt(spec)
            outcomes.append(None)
        except EngineInputError as exc:
            outcomes.append(exc.param)
    assert outcomes[0] == outcomes[1], outcomes
    assert not compiler.is_compiled(spec) if outcomes[1] else compiler.is_compiled(spec)


@pytest.mark.parametrize("settings", [{}, {"async_scheduling": True},
                                      {"speculative": {"num_speculative_tokens": 3}}], ids=["sync", "async", "drafts"])
def test_a_constraint_after_given_tokens_leaves_the_output_free_until_them(llm32, settings):
    """constrain_after (a reasoning model's end of thinking): the output is the model's own up to and including
    those tokens, then keeps to the constraint; under async scheduling and drafts too, which must not run a row
    ahead of its mask."""
    from engine import LLM

    llm = llm32 if not settings else LLM(dtype="float32", num_kv_blocks=128, **settings)
    prompt = "one two three four five " * 4 + "one two"  # repeats: n-gram drafts propose its continuation
    free = SamplingParams(max_tokens=8, temperature=0.0)
    (alone,) = llm.generate([prompt], free, use_tqdm=False)
    marker = tuple(alone.token_ids[2:4])  # the model's own 3rd and 4th tokens stand for "</think>"
    digits = StructuredOutput(regex="[0-9]{3}")
    after = SamplingParams(max_tokens=20, temperature=0.0, structured_output=digits, constrain_after=marker)
    at_once = SamplingParams(max_tokens=20, temperature=0.0, structured_output=digits)
    drafted = llm.engine.stats().spec_draft_tokens
    (waited, immediate) = llm.generate([prompt, prompt], [after, at_once], use_tqdm=False)
    assert waited.error is None and waited.token_ids[:4] == alone.token_ids[:4]
    tail = llm.inputs.tokenizer.decode(waited.token_ids[4:])
    assert re.fullmatch("[0-9]{3}", tail) and waited.finish_reason == "stop", (waited.text, tail)
    assert re.fullmatch("[0-9]{3}", immediate.text)
    if "speculative" in settings:
        assert drafted > 0  # unconstrained, this prompt's output is drafted: the waiting row would be too
    with pytest.raises(EngineInputError, match="constrain_after"):
        SamplingParams(constrain_after=(1, -2))
