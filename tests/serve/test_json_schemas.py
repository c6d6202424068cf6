"""Structured output over 20 JSON schemas (nested objects, arrays, enums, required fields, $ref, patterns, unions),
through the official client: every answer completes and validates with `jsonschema`."""
import concurrent.futures
import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"


def text(n: int) -> dict:
    return {"type": "string", "maxLength": n}


def integer(low: int, high: int) -> dict:
    return {"type": "integer", "minimum": low, "maximum": high}


def obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False}


SCHEMAS = {
    "person": obj({"name": text(20), "age": integer(0, 120)}),
    "enum": obj({"color": {"enum": ["red", "green", "blue"]}}),
    "int_array": obj({"numbers": {"type": "array", "items": integer(0, 100), "minItems": 1, "maxItems": 4}}),
    "nested_address": obj({"name": text(20), "address": obj({"street": text(30), "city": text(20),
                                                             "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})}),
    "boolean_and_optional": obj({"done": {"type": "boolean"}, "note": text(20)}, ["done"]),
    "array_of_objects": obj({"books": {"type": "array", "maxItems": 3,
                                       "items": obj({"title": text(20), "year": integer(1900, 2100)})}}),
    "top_level_array": {"type": "array", "items": text(10), "minItems": 1, "maxItems": 3},
    "top_level_enum": {"enum": ["yes", "no", "maybe"]},
    "number_in_range": obj({"price": {"type": "number", "minimum": 0, "maximum": 1000}}),
    "nested_arrays": obj({"matrix": {"type": "array", "maxItems": 2,
                                     "items": {"type": "array", "items": integer(0, 9), "maxItems": 2}}}),
    "optional_fields": obj({"a": text(10), "b": integer(0, 99), "c": {"type": "boolean"}}, ["a"]),
    "const": obj({"kind": {"const": "book"}, "title": text(20)}),
    "any_of": obj({"value": {"anyOf": [integer(0, 9), text(5)]}}),
    "nullable": obj({"middle_name": {"type": ["string", "null"], "maxLength": 10}}),
    "three_levels": obj({"a": obj({"b": obj({"c": integer(0, 9)})})}),
    "recipe": obj({"name": text(20), "vegan": {"type": "boolean"},
                   "ingredients": {"type": "array", "minItems": 1, "maxItems": 3,
                                   "items": obj({"item": text(15), "grams": integer(0, 1000)})}}),
    "date_pattern": obj({"date": {"type": "string", "pattern": "^2026-[01][0-9]-[0-3][0-9]$"}, "title": text(20)}),
    "enum_array": obj({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}),
    "top_level_integer": integer(1, 10),
    "refs": {"$defs": {"point": obj({"x": integer(0, 9), "y": integer(0, 9)})},
             **obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}})},
    "min_length": obj({"code": {"type": "string", "minLength": 3, "maxLength": 6}}),
}


@pytest.fixture(scope="module")
def client(serve_app):
    return openai.OpenAI(base_url=serve_app["base_url"] + "/v1", api_key=serve_app["api_key"], max_retries=0, timeout=180)


def answer(client, name: str, schema: dict):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"Fill in a {name.replace('_', ' ')} as JSON."}],
        max_tokens=200, temperature=0, response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}})


def test_every_answer_validates_against_its_schema(client):
    assert len(SCHEMAS) >= 20
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # one batch in the engine: the masks are per row
        answers = {name: pool.submit(answer, client, name, schema) for name, schema in SCHEMAS.items()}
        for name, future in answers.items():
            choice = future.result().choices[0]
            assert choice.finish_reason == "stop", (name, choice.message.content)
            jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
