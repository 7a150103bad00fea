"""Structured output: a request's StructuredOutput constraint, and its grammar.

The grammar engine is xgrammar, as in vLLM and SGLang: it compiles a JSON Schema, a regex or an
EBNF grammar against a vocabulary and, per step, fills a bitmask of the tokens that may come next
in a few microseconds. It is imported on first use only: the import loads torch and transformers
(about 3 s here), which a service that never sees a constraint should not pay for.

xgrammar is installed without its dependencies (pyproject.toml's [tool.shardline]): it asks for
triton, which only its CUDA mask kernel uses, and Shardline applies masks with torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from shardline.proto import sampling_pb2

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# How a worker's error starts when a request's grammar left it no token: the client's constraint
# is at fault (an empty language, a rule that never ends), so the gateway answers 400.
DEAD_END = "structured_output: its grammar allows no token"
# Bounds on what a client may send. They do not bound compile time (a schema of 64k characters,
# each property with a pattern, can take 40 s on a 2-core CPU), which is why workers compile off
# their step thread.
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 256
# Nesting of a JSON schema document (objects and arrays). Compile time grows about as its fourth
# power: on a 2-core CPU objects nested 150 deep (301 levels) compile in 0.6 s, 300 deep in 10-13 s, 480
# deep in 27 s; 49 deep (99 levels, within this bound) in 0.02 s. Real schemas stay far below.
MAX_SCHEMA_DEPTH = 100
# xgrammar's errors start with a log prefix: "[23:05:18] /project/cpp/regex_converter.cc:94: ".
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


@dataclass(frozen=True, slots=True)
class StructuredOutputSpec:
    """One constraint: `kind` is one of KINDS; `value` the schema, regex or grammar text, the choices,
    or "" for json_object."""

    kind: str
    value: str | tuple[str, ...] = ""
    any_whitespace: bool = True  # JSON kinds: free whitespace between tokens; False: '{"a": 1, "b": 2}'

    @classmethod
    def from_proto(cls, message: sampling_pb2.StructuredOutput) -> StructuredOutputSpec:
        """The spec of a StructuredOutput message; ValueError when it sets no kind or json_object=false."""
        kind = message.WhichOneof("kind")
        if kind is None:
            raise ValueError("structured_output: set one of " + ", ".join(KINDS))
        any_whitespace = not message.disable_any_whitespace
        if kind == "json_object":
            if not message.json_object:
                raise ValueError("structured_output: json_object must be true when set")
            return cls(kind, "", any_whitespace)
        if kind == "choice":
            return cls(kind, tuple(message.choice.choices), any_whitespace)
        return cls(kind, getattr(message, kind), any_whitespace)

    def to_proto(self) -> sampling_pb2.StructuredOutput:
        message = sampling_pb2.StructuredOutput(disable_any_whitespace=not self.any_whitespace)
        if self.kind == "json_object":
            message.json_object = True
        elif self.kind == "choice":
            message.choice.choices.extend(self.value)
        else:
            setattr(message, self.kind, self.value)
        return message

    def check(self) -> None:
        """Shape checks that need no grammar engine; ValueError starting with "structured_output"."""
        if self.kind not in KINDS:
            raise ValueError(f"structured_output: unknown kind {self.kind!r}; one of {', '.join(KINDS)}")
        if not self.any_whitespace and self.kind not in ("json_schema", "json_object"):
            raise ValueError("structured_output: disable_any_whitespace applies to json_schema and json_object only")
        if self.kind == "choice":
            if not self.value or len(self.value) > MAX_CHOICES:
                raise ValueError(f"structured_output: choice needs 1 to {MAX_CHOICES} strings")
            if not all(isinstance(c, str) and c for c in self.value):
                raise ValueError("structured_output: every choice must be a non-empty string")
            size = sum(len(c) for c in self.value)
        elif self.kind == "json_object":
            size = 0
        else:
            if not isinstance(self.value, str) or not self.value.strip():
                raise ValueError(f"structured_output: {self.kind} must be a non-empty string")
            size = len(self.value)
        if size > MAX_SPEC_CHARS:
            raise ValueError(f"structured_output: {self.kind} is {size} characters; at most {MAX_SPEC_CHARS}")
        if self.kind == "json_schema":
            assert isinstance(self.value, str)  # checked above
            try:
                schema = json.loads(self.value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_output: json_schema is not valid JSON ({exc})") from None
            if not isinstance(schema, dict):
                raise ValueError("structured_output: json_schema must be a JSON object")
            depth = _nesting(schema)
            if depth > MAX_SCHEMA_DEPTH:
                raise ValueError(
                    f"structured_output: json_schema is nested {depth} levels deep (objects and "
                    f"arrays); at most {MAX_SCHEMA_DEPTH}"
                )

    def grammar(self) -> Any:
        """The xgrammar Grammar; ValueError (naming structured_output) when it does not compile."""
        self.check()
        xgr = load_xgrammar()
        try:
            if self.kind == "json_schema":
                return xgr.Grammar.from_json_schema(self.value, any_whitespace=self.any_whitespace)
            if self.kind == "json_object":
                return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=self.any_whitespace)
            if self.kind == "regex":
                return xgr.Grammar.from_regex(self.value)
            if self.kind == "choice":
                # JSON's string escapes are EBNF's: quotes, backslashes and control characters.
                alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in self.value)
                return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
            return xgr.Grammar.from_ebnf(self.value)
        except RuntimeError as exc:
            raise compile_error(self.kind, exc) from None


def _nesting(value: Any) -> int:
    """How deeply objects and arrays nest in a decoded JSON value (a scalar: 0), without recursion."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        pending.extend((child, depth + 1) for child in children)
    return deepest


def compile_error(kind: str, exc: Exception) -> ValueError:
    """The client's error for the grammar engine's refusal of a constraint of `kind`."""
    reason = _LOG_PREFIX.sub("", str(exc).strip())
    return ValueError(f"structured_output: the {kind.replace('_', ' ')} does not compile: {reason}")


def load_xgrammar() -> ModuleType:
    """The xgrammar module; ValueError saying how to install it when it is missing."""
    try:
        import xgrammar
    except ImportError as exc:
        raise ValueError(
            f"structured_output: the grammar engine is not installed ({exc}); "
            f"install it with `pip install --no-deps xgrammar==0.2.9`"
        ) from None
    return xgrammar
