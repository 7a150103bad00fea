"""Tool calling in chat bodies: `tools`, `tool_choice` and `parallel_tool_calls`, as OpenAI defines them.

How each tool_choice is served (the way vLLM serves them):
- "none": the tools reach the chat template, the model answers in text, nothing is parsed;
- a named function ({"type": "function", "function": {"name": ...}}): the output is constrained to
  that function's `parameters` schema and returned as its one call's arguments;
- "required": the output is constrained to a JSON array of {"name", "parameters"} calls, at least
  one (exactly one without parallel_tool_calls), each naming a tool and fitting its schema;
- "auto" (the default when tools are given): the model writes text or calls in its chat template's
  own format, which a parser takes apart afterwards (`tool_call_parser`: "hermes" or "llama3_json"). A model whose
  template writes no tool calls cannot do "auto": the request is refused, not answered as if no tool fit.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from shardline.core.errors import InvalidArgument
from shardline.proto import generation_pb2, sampling_pb2
from shardline.structured_output import MAX_SPEC_CHARS

ToolChoice = Literal["none", "auto", "required", "named"]
# The parsers of "auto" output: the chat template formats they read.
TOOL_CALL_PARSERS = ("hermes", "llama3_json")
# OpenAI's rule for function names.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# Keywords that already decide what type the arguments are.
_SHAPED = ("type", "$ref", "anyOf", "oneOf", "allOf", "enum", "const")
# A call without parameters still has an arguments object.
_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(slots=True)
class ToolRequest:
    """The tools of a chat request and how the model may call them."""

    tools: list[dict[str, Any]]  # the OpenAI tool definitions, as sent (checked)
    choice: ToolChoice
    name: str = ""  # the function tool_choice names
    parallel: bool = True  # parallel_tool_calls: more than one call per turn
    parser: str = ""  # "auto": the format the model writes calls in (set once the model is known)
    schemas: dict[str, dict[str, Any]] = field(default_factory=dict)  # each function's parameters schema

    @property
    def tools_json(self) -> str:
        """The definitions for the chat template (under "none" too, as vLLM does: the model still knows them)."""
        return json.dumps(self.tools)

    def constraint(self) -> sampling_pb2.StructuredOutput | None:
        """The structured output that "required" and a named function put on the output. Arguments are
        written compactly, as OpenAI's are: fewer tokens, and small models loop on free whitespace."""
        if self.choice == "named":
            return sampling_pb2.StructuredOutput(
                json_schema=json.dumps(self.schemas[self.name]), disable_any_whitespace=True
            )
        if self.choice == "required":
            try:
                schema = json.dumps(self._calls_schema())
            except RecursionError:
                raise InvalidArgument("tools", "a tool's parameters schema is nested too deeply") from None
            if len(schema) > MAX_SPEC_CHARS:
                raise InvalidArgument(
                    "tools",
                    f'tool_choice "required" needs a schema of all the tools, and theirs '
                    f"come to {len(schema)} characters; at most {MAX_SPEC_CHARS}",
                )
            return sampling_pb2.StructuredOutput(json_schema=schema, disable_any_whitespace=True)
        return None

    def _calls_schema(self) -> dict[str, Any]:
        """vLLM's schema for "required": an array of calls, each one of the tools with its parameters.

        Each tool's schema sits whole under `$defs/tool_<i>`, its local references (`#`, `#/$defs/..`,
        `#/definitions/..`, `#/properties/..`) prefixed to point inside it: nested in place, as vLLM
        nests them, `#` would mean the whole array, and two tools' `$defs` could clash."""
        defs: dict[str, Any] = {}
        calls = []
        for i, (name, schema) in enumerate(self.schemas.items()):
            defs[f"tool_{i}"] = _rebased(schema, f"#/$defs/tool_{i}")
            calls.append(
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [name]},
                        "parameters": {"$ref": f"#/$defs/tool_{i}"},
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
            )
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, "$defs": defs}
        if not self.parallel:
            array["maxItems"] = 1
        return array


def tool_constraint(
    request: ToolRequest, given: sampling_pb2.StructuredOutput | None, given_field: str
) -> sampling_pb2.StructuredOutput | None:
    """The output constraint of "required" or a named function, None under "auto" and "none". A
    constraint the client gave itself (`given`, under `given_field`) cannot stand beside it."""
    constraint = request.constraint()
    if constraint is None:
        return None
    if given is not None:
        mode = "naming a function" if request.choice == "named" else f'"{request.choice}"'
        raise InvalidArgument(given_field, f"cannot be combined with tool_choice {mode}")
    return constraint


def tools_from_grpc(tools: generation_pb2.Tools) -> ToolRequest | None:
    """GenerateRequest.tools as a ToolRequest; errors name the Tools fields."""
    try:
        definitions = json.loads(tools.tools_json) if tools.tools_json else None
        json.dumps(definitions, ensure_ascii=False).encode()  # an escaped lone surrogate is no text
    except (ValueError, RecursionError):
        raise InvalidArgument("tools.tools_json", "must be a JSON array of tool definitions, in Unicode text") from None
    choice: Any = tools.choice or None
    if tools.function:
        choice = {"type": "function", "function": {"name": tools.function}}
        if definitions is None:
            raise InvalidArgument("tools.tools_json", "is needed to call a function")
    parallel = tools.parallel_tool_calls if tools.HasField("parallel_tool_calls") else None
    try:
        return tool_request(definitions, choice, parallel)
    except InvalidArgument as exc:
        field = exc.field
        if field.startswith("tools"):
            field = "tools.tools_json" + field[len("tools") :]
        elif field.startswith("tool_choice.function"):
            field = "tools.function"
        else:
            field = f"tools.{'choice' if field == 'tool_choice' else field}"
        raise InvalidArgument(field, str(exc).partition(": ")[2]) from None


def _rebased(node: Any, base: str) -> Any:
    """A schema with its local references ("#..." JSON pointers) moved under `base`."""
    if isinstance(node, dict):
        return {
            key: base + value[1:]
            if key == "$ref" and isinstance(value, str) and value.startswith("#")
            else _rebased(value, base)
            for key, value in node.items()
        }
    if isinstance(node, list):
        return [_rebased(value, base) for value in node]
    return node


def tool_request(tools: Any = None, tool_choice: Any = None, parallel_tool_calls: Any = None) -> ToolRequest | None:
    """The tool request of a chat's `tools`, `tool_choice` and `parallel_tool_calls`, as JSON gives
    them (None: not given); None without tools (or with tool_choice "none" and no tools)."""
    if tools is not None and not isinstance(tools, list):
        raise InvalidArgument("tools", "must be an array")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidArgument("parallel_tool_calls", "must be a boolean")
    if not tools:
        if tool_choice not in (None, "none"):
            raise InvalidArgument("tool_choice", "needs tools")
        return None
    schemas = {}
    for index, tool in enumerate(tools):
        name, schema = _tool(tool, f"tools[{index}]")
        if name in schemas:
            raise InvalidArgument(f"tools[{index}].function.name", f"{name!r} is defined twice")
        schemas[name] = schema
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    request = ToolRequest(tools, "auto", parallel=parallel, schemas=schemas)
    choice = tool_choice
    if choice is None or choice in ("none", "auto", "required"):
        request.choice = choice or "auto"
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not isinstance(name, str) or name not in schemas:
            raise InvalidArgument("tool_choice.function.name", f"names no tool in tools: {str(name)[:64]!r}")
        request.choice, request.name = "named", name
    else:
        raise InvalidArgument(
            "tool_choice", 'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
        )
    return request


def _tool(tool: Any, field: str) -> tuple[str, dict[str, Any]]:
    """A tool definition's function name and parameters schema, checked."""
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise InvalidArgument(field, 'must be {"type": "function", "function": {"name", "parameters", ...}}')
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidArgument(f"{field}.function.name", "must be 1 to 64 letters, digits, '_' or '-'")
    parameters = function.get("parameters")
    if parameters is None:
        return name, dict(_NO_PARAMETERS)
    if not isinstance(parameters, dict):
        raise InvalidArgument(f"{field}.function.parameters", "must be a JSON Schema object")
    for keyword in ("$defs", "definitions"):
        if not isinstance(parameters.get(keyword, {}), dict):
            raise InvalidArgument(f"{field}.function.parameters.{keyword}", "must be an object of schemas")
    if not any(keyword in parameters for keyword in _SHAPED):
        # Arguments are an object: a schema that says nothing of the type ({}, bare properties) would
        # also let the model write a number or a list.
        parameters = {"type": "object", **parameters}
    return name, parameters


def resolve_parser(request: ToolRequest, configured: str, template_format: str, field: str = "tool_choice") -> None:
    """Picks the parser of "auto" output: the gateway's setting, else what the chat template writes.
    `field` is where the client asked for "auto", for the error."""
    if request.choice != "auto":
        return
    parser = configured or template_format
    if parser not in TOOL_CALL_PARSERS:  # "none" too: the operator turned "auto" off
        raise InvalidArgument(
            field,
            '"auto" needs a model whose chat template writes tool calls, and this '
            'one\'s writes none; use "required" or a named function, which '
            "constrain the output to a call (or set SHARDLINE_TOOL_CALL_PARSER)",
        )
    request.parser = parser


def keeps_special_tokens(request: ToolRequest) -> bool:
    """Whether the request's special tokens stay in its text unless the client said otherwise. Hermes'
    <tool_call> tags are special tokens in some vocabularies (Hermes 2 Pro's): their text must reach
    the parser, as vLLM's hermes parser has it. The token the request stops on stays out either way."""
    return request.parser == "hermes"
