import torch

from gpu_worker_svc.engine.penalties import PenaltyState
from gpu_worker_svc.engine.sampling_params import SamplingParams
from gpu_worker_svc.engine.sequence import Sequence

VOCAB = 50


def make_seq(
    request_id: str = "r",
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    **params: object,
) -> Sequence:
    return Sequence(
        request_id=request_id,
        prompt_token_ids=prompt or [1, 2, 3],
        params=SamplingParams(seed=0, **params),
        output_token_ids=output or [],
    )


def expected_penalised(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """The formula, token by token: HF repetition over prompt + output, then OpenAI penalties."""
    params = seq.params
    rep = params.repetition_penalty
    out = row.clone()
    for token in set(seq.prompt_token_ids) | set(seq.output_token_ids):
        value = out[token]
        out[token] = value / rep if value > 0 else value * rep
    for token in set(seq.output_token_ids):
        count = seq.output_token_ids.count(token)
        out[token] -= params.frequency_penalty * count + params.presence_penalty
    return out


def random_logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_penalties_match_the_formula_and_spare_other_rows():
    logits = random_logits(2, seed=3)
    penalised = make_seq(
        prompt=[1, 2, 3], output=[3, 4, 4], repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25
    )
    plain = make_seq("plain", output=[3, 4])
    result = PenaltyState().apply(logits, [penalised, plain])
    torch.testing.assert_close(result[0], expected_penalised(logits[0], penalised))
    assert torch.equal(result[1], logits[1])
    assert not torch.equal(result[0], logits[0])


def test_no_penalties_returns_the_same_tensor():
    logits = random_logits(1, seed=0)
    assert PenaltyState().apply(logits, [make_seq()]) is logits


def test_cached_statistics_match_a_fresh_computation_each_step():
    state = PenaltyState()
    seqs = [
        make_seq("a", repetition_penalty=1.3, frequency_penalty=0.4),
        make_seq("b", prompt=[7, 7, 8], output=[9, 9], presence_penalty=-0.7),
    ]
    for step in range(6):
        logits = random_logits(2, seed=step)
        if step == 3:
            # A request missing from one step is rebuilt when it returns.
            state.apply(logits[:1], seqs[:1])
        result = state.apply(logits, seqs)
        fresh = PenaltyState().apply(logits, seqs)
        assert torch.equal(result, fresh)
        for i, seq in enumerate(seqs):
            torch.testing.assert_close(result[i], expected_penalised(logits[i], seq))
            seq.append_token((step * 7 + i) % 5 + 1)


def test_a_new_request_with_a_reused_id_is_not_served_stale_counts():
    state = PenaltyState()
    logits = random_logits(1, seed=1)
    state.apply(logits, [make_seq(output=[5, 5, 5], frequency_penalty=1.0)])
    fresh = make_seq(prompt=[10], output=[6], frequency_penalty=1.0)
    result = state.apply(logits, [fresh])
    torch.testing.assert_close(result[0], expected_penalised(logits[0], fresh))
