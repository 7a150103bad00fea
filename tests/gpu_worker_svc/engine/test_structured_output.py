"""Structured output with the real default model: the text parses, and the determinism the cluster's
failover relies on holds for constrained requests too (alone, batched, resumed)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from gpu_worker_svc.engine.batch_scheduler import SchedulerConfig
from gpu_worker_svc.engine.llm_engine import EngineConfig, LLMEngine
from gpu_worker_svc.engine.model_runner import RunnerConfig
from gpu_worker_svc.engine.sampling_params import SamplingParams
from shardline.core.model_path import default_model_path
from shardline.core.text.chat_template import ChatTemplate
from shardline.core.text.tokenizer import Tokenizer
from shardline.structured_output import StructuredOutputSpec

pytestmark = pytest.mark.slow

ANSWER_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no"]},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
        "reason": {"type": "string", "maxLength": 40},
    },
    "required": ["answer", "confidence", "reason"],
    "additionalProperties": False,
}
SEEDED = SamplingParams(max_tokens=80, temperature=0.9, top_p=0.95, seed=99)
GREEDY = SamplingParams(max_tokens=80, temperature=0.0)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_model_path(default_model_path())


@pytest.fixture(scope="module")
def chat(tokenizer):
    template = ChatTemplate(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token)

    def render(text: str) -> list[int]:
        prompt = template.render([{"role": "user", "content": text}], add_generation_prompt=True)
        return tokenizer.encode_batch([prompt], add_special_tokens=False)[0]

    return render


@pytest.fixture(scope="module")
def engine():
    e = LLMEngine(
        EngineConfig(
            runner=RunnerConfig(cpu_kv_bytes=64 << 20, max_model_len=512),
            scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512),
        )
    )
    yield e
    e.shutdown()


def _with(base: SamplingParams, kind: str, value: str | tuple[str, ...] = "", **changes) -> SamplingParams:
    return dataclasses.replace(base, structured_output=StructuredOutputSpec(kind, value), **changes)


@pytest.mark.parametrize("base", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_json_schema_output_parses_and_fits_the_schema(engine, tokenizer, chat, base):
    [result] = engine.generate(
        [chat("Is the sky blue? Answer in JSON.")], _with(base, "json_schema", json.dumps(ANSWER_SCHEMA))
    )
    assert result.finish_reason == "stop"
    value = json.loads(tokenizer.decode(result.token_ids))
    assert set(value) == {"answer", "confidence", "reason"}
    assert value["answer"] in ("yes", "no") and 0 <= value["confidence"] <= 100
    assert isinstance(value["reason"], str) and len(value["reason"]) <= 40


def test_compact_json_has_no_free_whitespace(engine, tokenizer, chat):
    spec = StructuredOutputSpec("json_schema", json.dumps(ANSWER_SCHEMA), any_whitespace=False)
    [result] = engine.generate(
        [chat("Is the sky blue? Answer in JSON.")], dataclasses.replace(GREEDY, structured_output=spec)
    )
    text = tokenizer.decode(result.token_ids)
    assert result.finish_reason == "stop" and text == json.dumps(json.loads(text))  # '{"a": 1, "b": 2}'


def test_json_object_regex_choice_and_grammar(engine, tokenizer, chat):
    specs = [
        ("json_object", ""),
        ("regex", r"[A-Z][a-z]+, [0-9]{5}"),
        ("choice", ("red", "green", "blue")),
        ("grammar", 'root ::= "The answer is " [0-9]+ "."'),
    ]
    prompts = [
        chat("What is the capital of France? Answer as JSON."),
        chat("Give a city and a postcode."),
        chat("Name a colour."),
        chat("What is 2+2?"),
    ]
    results = engine.generate(prompts, [_with(GREEDY, kind, value) for kind, value in specs])
    texts = [tokenizer.decode(r.token_ids) for r in results]
    assert [r.finish_reason for r in results] == ["stop"] * 4, texts
    assert isinstance(json.loads(texts[0]), dict)
    assert re.fullmatch(r"[A-Z][a-z]+, [0-9]{5}", texts[1])
    assert texts[2] in ("red", "green", "blue")
    assert re.fullmatch(r"The answer is [0-9]+\.", texts[3])


def test_a_constrained_request_is_the_same_alone_batched_and_resumed(engine, chat):
    prompt = chat("Is water wet? Answer in JSON.")
    params = _with(SEEDED, "json_schema", json.dumps(ANSWER_SCHEMA))
    [alone] = engine.generate([prompt], params)
    others = [chat(f"Tell me about the number {i}.") for i in range(5)]
    batched = engine.generate(
        [*others[:2], prompt, *others[2:]], [SEEDED, _with(SEEDED, "regex", "[a-z ]+"), params, SEEDED, GREEDY, SEEDED]
    )
    assert batched[2].token_ids == alone.token_ids
    cut = len(alone.token_ids) // 2
    engine.add_request("resumed", prompt, params, output_token_ids=alone.token_ids[:cut])
    rest: list[int] = []
    while engine.has_unfinished:
        for o in engine.step().outputs:
            rest += o.new_token_ids
    assert alone.token_ids[:cut] + rest == alone.token_ids


def test_a_complete_output_ends_the_request_despite_ignore_eos_and_min_tokens(engine, tokenizer, chat):
    [result] = engine.generate(
        [chat("Yes or no?")], _with(GREEDY, "choice", ("yes", "no"), ignore_eos=True, min_tokens=10, max_tokens=30)
    )
    assert result.finish_reason == "stop"
    assert tokenizer.decode(result.token_ids) in ("yes", "no")
    assert result.token_ids[-1] in tokenizer.eos_token_ids  # the grammar's end is EOS, nothing else


def test_max_tokens_still_cuts_a_structured_output(engine, chat):
    [result] = engine.generate([chat("Describe a cat in JSON.")], _with(GREEDY, "json_object", max_tokens=5))
    assert result.finish_reason == "length" and len(result.token_ids) == 5


def test_bad_constraints_and_resumes_are_refused(engine, tokenizer, chat):
    with pytest.raises(ValueError, match=r"^structured_output: the regex does not compile"):
        engine.add_request("bad-regex", [1, 2, 3], _with(GREEDY, "regex", "(ab"))
    with pytest.raises(ValueError, match=r"^structured_output: the json schema does not compile"):
        engine.add_request("bad-schema", [1, 2, 3], _with(GREEDY, "json_schema", '{"type": "objekt"}'))
    # An empty choice is the worker's edge's to refuse (tests/gpu_worker_svc/server/test_request_params.py).
    [done] = engine.generate([chat("Yes or no?")], _with(GREEDY, "choice", ("yes", "no")))
    with pytest.raises(ValueError, match=r"^output_token_ids: the structured output is already complete"):
        engine.add_request(
            "complete", chat("Yes or no?"), _with(GREEDY, "choice", ("yes", "no")), output_token_ids=done.token_ids
        )
    stray = tokenizer.encode_batch(["maybe"], add_special_tokens=False)[0]
    with pytest.raises(ValueError, match=r"^output_token_ids: token \d+ at index 0"):
        engine.add_request("stray", chat("Yes or no?"), _with(GREEDY, "choice", ("yes", "no")), output_token_ids=stray)
    assert not engine.has_unfinished


def test_a_grammar_with_no_way_on_fails_its_own_request_and_no_other(engine, tokenizer, chat):
    """An empty language, or a rule that never ends, compiles; the step then allows no token at all."""
    prompts = [chat("Say a."), chat("Say b."), chat("Count to three."), chat("Count to four.")]
    params = [
        _with(GREEDY, "regex", r"a[^\s\S]"),
        _with(SEEDED, "grammar", 'root ::= "b" r\nr ::= r'),
        _with(SEEDED, "regex", r"[^\s\S]"),
        dataclasses.replace(GREEDY, max_tokens=8),
    ]
    results = engine.generate(prompts, params)
    assert [r.finish_reason for r in results] == ["error", "error", "error", "length"]
    assert all(r.error.startswith("structured_output: its grammar allows no token") for r in results[:3])
    assert [tokenizer.decode(r.token_ids) for r in results[:3]] == ["a", "b", ""]  # the refused token is not output
    assert len(results[3].token_ids) == 8
    engine.add_request("dead-end", prompts[0], params[0])
    errors = [o.error for _ in range(4) for o in engine.step().outputs if o.finish_reason == "error"]
    assert errors == [
        "structured_output: its grammar allows no token after 1 output tokens (it has no valid completion from there)"
    ]


def test_min_tokens_holds_a_structured_output_open_until_its_grammar_must_end(engine, tokenizer, chat):
    prompt, spec = chat("Yes or no?"), ("regex", "(yes|no)[0-9]{0,6}")
    [free] = engine.generate([prompt], _with(GREEDY, *spec, max_tokens=20))
    assert tokenizer.decode(free.token_ids) in ("yes", "no")  # EOS as soon as the grammar allows it
    [held] = engine.generate([prompt], _with(GREEDY, *spec, max_tokens=20, min_tokens=4))
    assert held.finish_reason == "stop" and held.token_ids[-1] == tokenizer.eos_token_ids[0]
    assert len(held.token_ids) > 4 and re.fullmatch("(yes|no)[0-9]+", tokenizer.decode(held.token_ids))
    # ignore_eos does not let the grammar's EOS through early either: it would still end the request.
    [ignoring] = engine.generate([prompt], _with(GREEDY, *spec, max_tokens=20, min_tokens=4, ignore_eos=True))
    assert ignoring.token_ids == held.token_ids and ignoring.finish_reason == "stop"


def test_drafts_under_a_grammar_give_the_same_output(engine, tokenizer, chat):
    """n-gram speculation on constrained requests: drafts the grammar refuses are cut at proposal,
    each row's mask is the grammar's after the drafts it follows, and the output is the same."""
    from gpu_worker_svc.engine.ngram_proposer import SpeculativeConfig

    rows_schema = {
        "type": "array",
        "minItems": 4,
        "maxItems": 4,
        "items": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
            "required": ["name", "age"],
            "additionalProperties": False,
        },
    }
    requests = [
        (chat("List four people with their ages as JSON."), _with(GREEDY, "json_schema", json.dumps(rows_schema))),
        (chat("Is water wet? Answer in JSON."), _with(SEEDED, "json_schema", json.dumps(ANSWER_SCHEMA))),
        (chat("Say red five times."), _with(GREEDY, "regex", "(red, ){4}red")),
    ]
    plain = engine.generate([p for p, _ in requests], [q for _, q in requests])
    engine.config.speculative = SpeculativeConfig(num_speculative_tokens=4)
    try:
        for i, (prompt, params) in enumerate(requests):
            engine.add_request(str(i), prompt, params)
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(requests))}
        accepted = 0
        while engine.has_unfinished:
            step = engine.step()
            accepted += step.stats.num_accepted_tokens if step.stats else 0
            for out in step.outputs:
                assert out.error is None
                tokens[out.request_id] += out.new_token_ids
    finally:
        engine.config.speculative = SpeculativeConfig()
    assert accepted > 0
    assert [tokens[str(i)] for i in range(len(requests))] == [r.token_ids for r in plain]
    json.loads(tokenizer.decode(tokens["0"]))
