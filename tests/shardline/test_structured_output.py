"""StructuredOutputSpec: the proto's constraint, its shape checks, and its grammar."""

from __future__ import annotations

import json

import pytest

from shardline.proto import sampling_pb2
from shardline.structured_output import MAX_CHOICES, MAX_SCHEMA_DEPTH, MAX_SPEC_CHARS, StructuredOutputSpec


@pytest.mark.parametrize(
    "message",
    [
        sampling_pb2.StructuredOutput(json_schema='{"type": "integer"}'),
        sampling_pb2.StructuredOutput(json_object=True),
        sampling_pb2.StructuredOutput(regex="[a-z]+"),
        sampling_pb2.StructuredOutput(choice=sampling_pb2.Choices(choices=["a", "b"])),
        sampling_pb2.StructuredOutput(grammar='root ::= "x"'),
        sampling_pb2.StructuredOutput(json_object=True, disable_any_whitespace=True),
    ],
)
def test_round_trips_through_the_proto(message):
    spec = StructuredOutputSpec.from_proto(message)
    assert spec.to_proto() == message
    spec.check()
    assert spec.grammar() is not None


def _nested_schema(depth: int) -> str:
    """Objects `depth` deep, each with one property: two levels of the document per object, and
    one for the innermost schema."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"e": schema}}
    return json.dumps(schema)


def test_a_schema_at_the_nesting_bound_compiles():
    assert StructuredOutputSpec("json_schema", _nested_schema((MAX_SCHEMA_DEPTH - 1) // 2)).grammar() is not None


@pytest.mark.parametrize(
    "spec, error",
    [
        (StructuredOutputSpec("yaml", "x"), "unknown kind 'yaml'"),
        (StructuredOutputSpec("regex", "  "), "regex must be a non-empty string"),
        (StructuredOutputSpec("choice", ()), f"choice needs 1 to {MAX_CHOICES} strings"),
        (StructuredOutputSpec("choice", ("a", "")), "every choice must be a non-empty string"),
        (StructuredOutputSpec("json_schema", "[1, 2]"), "json_schema must be a JSON object"),
        (StructuredOutputSpec("json_schema", "{"), "json_schema is not valid JSON"),
        (StructuredOutputSpec("json_schema", "true"), "json_schema must be a JSON object"),
        (StructuredOutputSpec("regex", "a+", any_whitespace=False), "disable_any_whitespace applies to json_schema"),
        (StructuredOutputSpec("grammar", "x" * (MAX_SPEC_CHARS + 1)), "grammar is 65537 characters"),
        # Compile time grows with nesting far faster than with size: 480 objects deep took 27 s.
        (StructuredOutputSpec("json_schema", _nested_schema(51)), "json_schema is nested 103 levels deep"),
    ],
)
def test_shape_errors_name_the_field(spec, error):
    with pytest.raises(ValueError, match=r"^structured_output: ") as caught:
        spec.check()
    assert error in str(caught.value)


def test_compile_errors_lose_the_engines_log_prefix():
    with pytest.raises(ValueError) as caught:
        StructuredOutputSpec("json_schema", json.dumps({"type": "objekt"})).grammar()
    assert str(caught.value) == 'structured_output: the json schema does not compile: Unsupported type "objekt"'


def test_choices_are_matched_literally():
    """Quotes, backslashes and newlines in a choice are its own characters, not EBNF syntax."""
    xgrammar = pytest.importorskip("xgrammar")
    choices = ('say "hi"', "a\\b", "two\nlines", "été")
    grammar = StructuredOutputSpec("choice", choices).grammar()
    for choice in choices:
        assert xgrammar.testing._is_grammar_accept_string(grammar, choice), choice
    assert not xgrammar.testing._is_grammar_accept_string(grammar, "say hi")


def test_the_sdk_takes_one_constraint_and_refuses_a_bare_string_of_choices():
    from shardline.client.types import build_request

    req = build_request("hi", json_schema={"type": "object"}, disable_any_whitespace=True)
    assert json.loads(req.params.structured_output.json_schema) == {"type": "object"}
    assert req.params.structured_output.disable_any_whitespace
    assert list(build_request("hi", choice=["yes", "no"]).params.structured_output.choice.choices) == ["yes", "no"]
    assert not build_request("hi", disable_any_whitespace=False).params.HasField("structured_output")
    with pytest.raises(ValueError, match="choice must be a list of strings"):
        build_request("hi", choice="yes")
    with pytest.raises(ValueError, match="give one structured output constraint"):
        build_request("hi", regex="a+", grammar='root ::= "a"')
