"""``text.format`` on /v1/responses through the real ``openai`` client
against the session server (the embedded SmolLM2): json_schema via
``client.responses.parse(text_format=...)`` and ``responses.stream``,
json_object, the echo on the response object, and 400s naming the field.
It takes chat's response_format path, so the grammar makes every output
schema-valid and the same schema checks refuse the same schemas."""
from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.serve.server_process import MODEL_NAME
from tests.serve.test_responses import RESPONSES_WEATHER
from tests.serve.test_structured import PERSON

pytestmark = pytest.mark.usefixtures("healthy")

class Person(BaseModel):
    # Bounded lengths keep a greedy tiny model from writing one string forever.
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=130)
    likes: list[Literal["tea", "coffee", "cake"]] = Field(max_length=3)


def test_parse_with_a_pydantic_text_format(client):
    r = client.responses.parse(model=MODEL_NAME, input="Invent a pirate captain.", text_format=Person,
                               max_output_tokens=120, temperature=0)
    assert r.status == "completed", r.output_text
    person = r.output_parsed
    assert isinstance(person, Person) and Person.model_validate_json(r.output_text) == person
    # The response echoes the format the client asked for.
    fmt = r.text.format
    assert fmt.type == "json_schema" and fmt.name == "Person" and fmt.strict is True
    assert fmt.schema_["properties"]["age"] == {"type": "integer", "minimum": 0, "maximum": 130, "title": "Age"}
    assert client.responses.retrieve(r.id).text.format.name == "Person"  # stored with it


def test_json_object_gives_parseable_json(client):
    r = client.responses.create(model=MODEL_NAME, input='Return a JSON object with the key "ok" set to true.',
                                text={"format": {"type": "json_object"}}, max_output_tokens=150, temperature=0)
    assert r.status == "completed", r.output_text
    assert isinstance(json.loads(r.output_text), dict)
    assert r.text.format.type == "json_object"
    plain = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2,
                                    text={"format": {"type": "text"}})
    assert plain.text.format.type == "text"


def test_streamed_json_schema_is_valid_when_concatenated(client):
    """Through the client's streaming helper, which sends text.format and
    parses the final text into the model."""
    with client.responses.stream(model=MODEL_NAME, input="Describe a baker from Lyon.", text_format=Person,
                                 max_output_tokens=120, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert isinstance(final.output_parsed, Person) and Person.model_validate_json(text) == final.output_parsed
    jsonschema.validate(json.loads(text), final.text.format.schema_)
    assert events[-1].type == "response.completed" and final.output_text == text
    assert events[0].response.text.format.name == "Person"  # echoed from the first event on


def _schema_format(schema: object, **extra: object) -> dict:
    return {"type": "json_schema", "name": "x", "schema": schema, **extra}


@pytest.mark.parametrize("fmt,extra,param", [
    # Nothing is ever fetched: a reference outside the schema is refused.
    (_schema_format({"$ref": "https://example.com/person.json"}), {}, "text.format.schema"),
    (_schema_format({"type": "object", "properties": {"a": {"$ref": "http://127.0.0.1:1/a"}}}), {},
     "text.format.schema"),
    (_schema_format({"type": "nope"}), {}, "text.format.schema"),
    # A pattern that needs backtracking (a backreference) has no grammar.
    (_schema_format({"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a)\\1$"}}}), {},
     "text.format.schema"),
    (_schema_format(5), {}, "text.format.schema"),
    ({"type": "json_schema", "name": "x"}, {}, "text.format.schema"),
    ({"type": "json_schema", "schema": PERSON}, {}, "text.format.name"),
    (_schema_format(PERSON, name="has space"), {}, "text.format.name"),
    ({"type": "yaml"}, {}, "text.format.type"),
    # One output constraint per request, however it is asked for.
    ({"type": "json_object"}, {"guided_regex": "a+"}, "guided_regex"),
    ({"type": "json_object"}, {"response_format": {"type": "json_object"}}, "text.format"),
    ({"type": "json_object"}, {"tools": [RESPONSES_WEATHER], "tool_choice": "required"}, "tool_choice"),
])
def test_bad_formats_are_400_naming_the_field(client, fmt, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=5, text={"format": fmt},
                                extra_body=extra)
    assert info.value.body["param"] == param, info.value.body
