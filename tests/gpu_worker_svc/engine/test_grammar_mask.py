"""The step's structured-output mask, without a model: it forbids exactly what the grammar's bitmask
does (xgrammar's own CPU kernel is the reference), only on the constrained rows."""

from __future__ import annotations

import json

import pytest
import torch

from gpu_worker_svc.engine.grammar import GrammarBackend, mask_logits
from gpu_worker_svc.engine.sampling_params import SamplingParams
from gpu_worker_svc.engine.sequence import Sequence
from shardline.structured_output import StructuredOutputSpec

xgrammar = pytest.importorskip("xgrammar")

# A toy vocabulary: single characters, a few words, and EOS (id 0, no text). 70 ids span 3 words of bits.
VOCAB = [
    b"",
    *(bytes([c]) for c in b'{}[]":, 0123456789abcdefghijklmnopqrstuvwxyz'),
    b'{"',
    b'":',
    b"true",
    b"false",
    b"null",
    b'"}',
    b"  ",
]
WIDTH = 70  # the model's logits may be wider than its vocabulary: the rest is never allowed


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    return GrammarBackend(VOCAB + [b""] * (WIDTH - len(VOCAB)), WIDTH, stop_token_ids=[0])


def _seq(name: str, spec: StructuredOutputSpec | None, backend: GrammarBackend, output: list[int]) -> Sequence:
    seq = Sequence(name, [1], SamplingParams(structured_output=spec), eos_token_id=0, output_token_ids=list(output))
    if spec is not None:
        seq.grammar = backend.matcher(spec, output)
    return seq


def test_the_mask_matches_the_grammars_bitmask_row_by_row(backend):
    ids = {token: i for i, token in enumerate(VOCAB)}
    schema = StructuredOutputSpec(
        "json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]})
    )
    seqs = [
        _seq("free", None, backend, []),
        _seq("start", schema, backend, []),
        _seq("mid", schema, backend, [ids[b'{"'], ids[b"a"], ids[b'":']]),
        _seq("free2", None, backend, [5, 6]),
        _seq("digits", StructuredOutputSpec("regex", "[0-9]+"), backend, [ids[b"7"]]),
    ]
    logits = torch.randn(len(seqs), WIDTH)
    masked = mask_logits(logits, [seq.grammar for seq in seqs])

    for row, seq in enumerate(seqs):
        if seq.grammar is None:
            assert torch.equal(masked[row], logits[row])  # untouched, bit for bit
            continue
        expected = logits[row].clone()
        bitmask = xgrammar.allocate_token_bitmask(1, WIDTH)
        seq.grammar.fill(bitmask, 0)
        xgrammar.apply_token_bitmask_inplace(expected[None], bitmask, vocab_size=WIDTH)
        assert torch.equal(masked[row], expected), seq.request_id
    allowed = {
        seq.request_id: [VOCAB[i] for i in torch.isfinite(masked[r]).nonzero().flatten().tolist()]
        for r, seq in enumerate(seqs)
        if seq.grammar is not None
    }
    assert b"{" in allowed["start"] and b"a" not in allowed["start"]
    assert set(allowed["mid"]) <= {b"true", b"false", b"t", b"f", b" ", b"  "}
    assert b"" in allowed["digits"] and b"7" in allowed["digits"] and b"a" not in allowed["digits"]  # EOS may end it


def test_an_unconstrained_batch_is_returned_as_is(backend):
    logits = torch.randn(3, WIDTH)
    assert mask_logits(logits, [_seq(f"s{i}", None, backend, []).grammar for i in range(3)]) is logits


def test_a_resume_replays_the_output_and_refuses_a_stray_token(backend):
    ids = {token: i for i, token in enumerate(VOCAB)}
    spec = StructuredOutputSpec("choice", ("true", "false"))
    matcher = backend.matcher(spec, [ids[b"f"], ids[b"a"]])
    assert matcher.accept(ids[b"l"]) and not matcher.accept(ids[b"x"])
    with pytest.raises(ValueError, match=r"^output_token_ids: token \d+ at index 1 is not allowed"):
        backend.matcher(spec, [ids[b"t"], ids[b"x"]])


def test_the_sampler_never_picks_a_forbidden_token_even_when_the_allowed_ones_noise_is_infinite(backend, monkeypatch):
    """A uniform draw of exactly 0 gives infinite noise: the allowed token then scores 0, as the
    forbidden (probability 0) ones do, and must still win."""
    from gpu_worker_svc.engine import sampler as sampler_module
    from gpu_worker_svc.engine.sampler import Sampler

    ids = {token: i for i, token in enumerate(VOCAB)}
    seq = _seq("forced", StructuredOutputSpec("choice", ("true",)), backend, [ids[b"t"]])
    seq.params.temperature, seq.params.seed = 1.0, 5

    def infinite_for_allowed(seqs, vocab, device, ahead=None):
        noise = torch.ones(len(seqs), vocab)
        noise[:, ids[b"r"]] = float("inf")
        return noise

    monkeypatch.setattr(sampler_module, "race_noise", infinite_for_allowed)
    assert Sampler()(torch.randn(1, WIDTH), [seq]).token_ids == [ids[b"r"]]


def test_rows_after_drafts_get_the_grammars_mask_after_them(backend):
    """n-gram speculation: a draft the grammar refuses is cut off at proposal (valid_prefix), and a
    row after drafts gets the mask of its request advanced over them; the matcher stays put."""
    ids = {token: i for i, token in enumerate(VOCAB)}
    schema = StructuredOutputSpec(
        "json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]})
    )
    seq = _seq("s", schema, backend, [])
    drafts = [ids[b'{"'], ids[b"a"], ids[b'":'], ids[b"7"], ids[b"true"]]
    assert seq.grammar.valid_prefix(drafts) == 3  # a 7 is no boolean
    logits = torch.randn(4, WIDTH)
    masked = mask_logits(logits, [seq.grammar] * 4, [drafts[:k] for k in range(4)])
    for k in range(4):
        further = _seq(f"s{k}", schema, backend, drafts[:k])
        assert torch.equal(masked[k], mask_logits(logits[k : k + 1], [further.grammar])[0]), k
    assert torch.equal(mask_logits(logits[:1], [seq.grammar])[0], masked[0])  # back where it was
