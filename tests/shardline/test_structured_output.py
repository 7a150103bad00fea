"""StructuredOutputSpec: the proto's constraint, its shape checks, and its grammar."""

from __future__ import annotations

import json

import pytest

from shardline.proto import sampling_pb2
from shardline.structured_output import MAX_CHOICES, MAX_SPEC_CHARS, StructuredOutputSpec


@pytest.mark.parametrize("message", [
    sampling_pb2.StructuredOutput(json_schema='{"type": "integer"}'),
    sampling_pb2.StructuredOutput(json_object=True),
    sampling_pb2.StructuredOutput(regex="[a-z]+"),
    sampling_pb2.StructuredOutput(choice=sampling_pb2.Choices(choices=["a", "b"])),
    sampling_pb2.StructuredOutput(grammar='root ::= "x"'),
])
def test_round_trips_through_the_proto(message):
    spec = StructuredOutputSpec.from_proto(message)
    assert spec.to_proto() == message
    spec.check()
    assert spec.grammar() is not None


@pytest.mark.parametrize("spec, error", [
    (StructuredOutputSpec("yaml", "x"), "unknown kind 'yaml'"),
    (StructuredOutputSpec("regex", "  "), "regex must be a non-empty string"),
    (StructuredOutputSpec("choice", ()), f"choice needs 1 to {MAX_CHOICES} strings"),
    (StructuredOutputSpec("choice", ("a", "")), "every choice must be a non-empty string"),
    (StructuredOutputSpec("json_schema", "[1, 2]"), "json_schema must be a JSON object"),
    (StructuredOutputSpec("json_schema", "{"), "json_schema is not valid JSON"),
    (StructuredOutputSpec("grammar", "x" * (MAX_SPEC_CHARS + 1)), "grammar is 65537 characters"),
])
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
