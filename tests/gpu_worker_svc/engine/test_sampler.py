from collections import Counter

import pytest
import torch

from gpu_worker_svc.engine.sampler import Sampler, draw_key, race_noise, token_logprobs
from gpu_worker_svc.engine.sampling_params import SamplingParams
from gpu_worker_svc.engine.sequence import Sequence

EOS = 0
VOCAB = 1000


def make_seq(
    seed: int | None = 0,
    output: list[int] | None = None,
    prompt: list[int] | None = None,
    **params: object,
) -> Sequence:
    return Sequence(
        request_id=f"r{seed}",
        prompt_token_ids=prompt or [5, 6, 7],
        params=SamplingParams(seed=seed, **params),
        eos_token_id=EOS,
        output_token_ids=output or [],
    )


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def frequencies(probs: list[float], num_draws: int = 4000, **params: object) -> dict[int, float]:
    """Sample one row with the given distribution num_draws times, one seed each."""
    logits = torch.tensor(probs).log().expand(num_draws, -1).contiguous()
    seqs = [make_seq(seed=i, **params) for i in range(num_draws)]
    counts = Counter(Sampler()(logits, seqs).token_ids)
    return {token: n / num_draws for token, n in counts.items()}


def test_race_noise_is_keyed_by_seed_and_token_index_alone():
    seqs = [make_seq(seed=3, output=[1] * 7), make_seq(seed=3, output=[1] * 8), make_seq(seed=4, output=[1] * 7)]
    noise = race_noise(seqs, VOCAB, torch.device("cpu"))
    assert torch.equal(noise[0], race_noise(seqs[:1], VOCAB, torch.device("cpu"))[0])  # alone or batched
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    assert (noise > 0).all() and noise.mean().item() == pytest.approx(1.0, abs=0.1)  # Exp(1)
    assert draw_key(-1, 0) == draw_key(2**64 - 1, 0)


def test_float_noise_in_the_logits_rarely_changes_a_seeded_draw():
    """A request's float32 logits differ by ~1e-5 between batch shapes. With a long flat tail (here
    1,000 tokens share 30% of the mass) an inverse-CDF draw changed its token whenever it landed in
    the tail; the exponential race changes only when its two best scores are within the noise."""
    head = torch.tensor([0.4, 0.2, 0.1])
    tail = torch.full((1000,), 0.3 / 1000) * (1 + 0.01 * torch.rand(1000, generator=torch.Generator().manual_seed(1)))
    logits = torch.cat([head, tail]).log().expand(2000, -1).contiguous()
    jitter = 1e-5 * torch.randn(logits.shape, generator=torch.Generator().manual_seed(2))
    seqs = [make_seq(seed=i) for i in range(2000)]
    clean, jittered = Sampler()(logits, seqs).token_ids, Sampler()(logits + jitter, seqs).token_ids
    assert sum(a != b for a, b in zip(clean, jittered)) <= 2


def test_greedy_takes_argmax():
    logits = random_logits(4)
    seqs = [make_seq(seed=None, temperature=0.0) for _ in range(4)]
    out = Sampler()(logits, seqs)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 4


def test_top_k_one_equals_greedy():
    logits = random_logits(8, seed=1)
    seqs = [make_seq(seed=i, top_k=1, temperature=1.5) for i in range(8)]
    assert Sampler()(logits, seqs).token_ids == logits.argmax(dim=-1).tolist()


def test_seeded_row_is_independent_of_batch_and_repeatable():
    logits = random_logits(6, seed=2)
    target = make_seq(seed=1234, output=[9, 9], temperature=0.8)
    others = [
        make_seq(seed=None, temperature=0.0),
        make_seq(seed=5, top_k=3),
        make_seq(seed=6, top_p=0.3, min_p=0.2),
        make_seq(seed=7, repetition_penalty=1.3, presence_penalty=0.4),
        make_seq(seed=8, min_tokens=4, logprobs=2),
    ]
    sampler = Sampler()
    alone = sampler(logits[3:4], [target]).token_ids[0]
    batch = [*others[:3], target, *others[3:]]
    in_batch = sampler(logits, batch).token_ids[3]
    assert alone == in_batch
    assert all(sampler(logits, batch).token_ids[3] == alone for _ in range(3))


def test_draw_depends_on_seed_and_token_index():
    logits = torch.zeros(1, VOCAB)  # uniform: any draw is equally likely
    by_seed = {Sampler()(logits, [make_seq(seed=s)]).token_ids[0] for s in range(20)}
    by_index = {Sampler()(logits, [make_seq(seed=1, output=[3] * n)]).token_ids[0] for n in range(20)}
    assert len(by_seed) > 15 and len(by_index) > 15


def test_unrestricted_frequencies_follow_the_distribution():
    probs = [0.4, 0.3, 0.2, 0.05, 0.05]
    freq = frequencies(probs)
    for token, p in enumerate(probs):
        assert freq.get(token, 0.0) == pytest.approx(p, abs=0.03)


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"top_p": 0.75}, {0: 0.4 / 0.9, 1: 0.3 / 0.9, 2: 0.2 / 0.9}),
        ({"min_p": 0.4}, {0: 0.4 / 0.9, 1: 0.3 / 0.9, 2: 0.2 / 0.9}),
        ({"top_k": 2}, {0: 4 / 7, 1: 3 / 7}),
        # top_p applies to the mass left by top_k: 0.5 of 0.9 needs two tokens.
        ({"top_k": 3, "top_p": 0.5}, {0: 4 / 7, 1: 3 / 7}),
        ({"min_p": 0.6, "top_p": 0.9}, {0: 4 / 7, 1: 3 / 7}),
        ({"temperature": 0.5, "top_k": 2}, {0: 16 / 25, 1: 9 / 25}),
    ],
)
def test_filters_restrict_support_and_renormalise(params, expected):
    freq = frequencies([0.4, 0.3, 0.2, 0.05, 0.05], **params)
    assert set(freq) == set(expected)
    for token, p in expected.items():
        assert freq[token] == pytest.approx(p, abs=0.03)


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, 10], logits[0, 11] = 4.0, 3.0
    seq = make_seq(seed=None, prompt=[10], temperature=0.0, repetition_penalty=2.0)
    assert Sampler()(logits, [seq]).token_ids == [11]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS], logits[0, 42], logits[0, 17] = 5.0, 4.0, 3.0
    sampler = Sampler()

    def pick(**params: object) -> int:
        return sampler(logits, [make_seq(seed=None, temperature=0.0, **params)]).token_ids[0]

    assert pick(min_tokens=2, stop_token_ids=[42], output=[9]) == 17
    assert pick(min_tokens=2, stop_token_ids=[42], output=[9, 9]) == EOS
    assert pick(min_tokens=2, output=[9]) == 42
    # With ignore_eos, EOS is an ordinary token and is not masked.
    assert pick(min_tokens=2, ignore_eos=True, output=[9]) == EOS
    # A stop id past the vocabulary cannot be sampled and needs no mask.
    assert pick(min_tokens=2, stop_token_ids=[VOCAB + 5]) == 42


def test_logprobs_come_from_raw_logits():
    logits = random_logits(3, seed=4)
    seqs = [
        make_seq(seed=1, logprobs=3, temperature=0.7, repetition_penalty=1.2),
        make_seq(seed=2, logprobs=0),
        make_seq(seed=3),
    ]
    out = Sampler()(logits, seqs)
    raw = torch.log_softmax(logits, dim=-1)
    first, second, third = out.logprobs
    assert third is None
    assert second.top == [] and second.token_id == out.token_ids[1]
    assert second.logprob == pytest.approx(raw[1, out.token_ids[1]].item())
    assert first.logprob == pytest.approx(raw[0, out.token_ids[0]].item())
    values, ids = torch.topk(raw[0], 3)
    assert [t for t, _ in first.top] == ids.tolist()
    assert [v for _, v in first.top] == pytest.approx(values.tolist())
    assert all(a[1] >= b[1] for a, b in zip(first.top, first.top[1:]))


def test_a_tokens_rank_counts_the_tokens_at_least_as_likely():
    # vLLM's rank: 1 for the most likely token; a tie counts the other token too.
    raw = torch.log_softmax(torch.tensor([[2.0, 1.0, 3.0, 1.0, 0.5], [0.0, 0.0, 0.0, 0.0, 0.0]]), dim=-1)
    first, second = token_logprobs(raw, [2, 1], [0, 0])
    assert first.rank == 1
    assert second.rank == 5  # all five are as likely
    ranks = [entry.rank for entry in token_logprobs(raw[:1].expand(5, -1), [0, 1, 2, 3, 4], [0] * 5)]
    assert ranks == [2, 4, 1, 4, 5]
    # Sampled tokens carry theirs: greedy picks the most likely.
    out = Sampler()(
        random_logits(2, seed=5),
        [make_seq(seed=None, temperature=0.0, logprobs=1), make_seq(seed=6, temperature=5.0, logprobs=1)],
    )
    greedy, hot = out.logprobs
    assert greedy.rank == 1
    assert hot.rank == int((torch.log_softmax(random_logits(2, seed=5)[1], -1) >= hot.logprob).sum())


def test_sampling_without_seed_is_an_error():
    with pytest.raises(ValueError, match="no seed"):
        Sampler()(torch.zeros(1, VOCAB), [make_seq(seed=None)])


def test_logits_shape_must_match_batch():
    with pytest.raises(ValueError, match="logits must be"):
        Sampler()(torch.zeros(2, VOCAB), [make_seq()])


def test_a_nucleus_wider_than_the_head_sorts_the_whole_vocabulary():
    """top_p looks among the 1,024 likeliest tokens first; a wider nucleus must still be whole."""
    vocab = 3000
    logits = torch.zeros(400, vocab)  # uniform: the stable order is token-id order
    seqs = [make_seq(seed=i, top_p=0.5) for i in range(400)]
    tokens = Sampler()(logits, seqs).token_ids
    assert max(tokens) < 1500 and any(t >= 1024 for t in tokens)


def test_logit_bias_moves_the_choice_of_its_row_only():
    logits = random_logits(3, seed=7)
    plain = [make_seq(seed=None, temperature=0.0), make_seq(seed=5), make_seq(seed=None, temperature=0.0)]
    top = int(logits[0].argmax())
    biased = [
        make_seq(seed=None, temperature=0.0, logit_bias={top: -100.0, 3: 1.5}),
        make_seq(seed=5, logit_bias={42: 100.0, VOCAB + 7: 5.0}),  # an id past the vocabulary is ignored
        plain[2],
    ]
    out = Sampler()(logits, biased)
    expected_first = int((logits[0] + torch.eye(VOCAB)[3] * 1.5 - torch.eye(VOCAB)[top] * 100).argmax())
    assert out.token_ids[0] == expected_first != top
    assert out.token_ids[1] == 42  # +100 outweighs any logit of a real model
    assert out.token_ids[2] == Sampler()(logits, plain).token_ids[2]  # the unbiased row is untouched
    assert torch.equal(logits, random_logits(3, seed=7))  # the caller's logits are not changed


def test_logit_bias_leaves_the_logprobs_the_models():
    logits = random_logits(1, seed=8)
    out = Sampler()(logits, [make_seq(seed=None, temperature=0.0, logprobs=2, logit_bias={9: 100.0})])
    assert out.token_ids == [9]
    assert out.logprobs[0].logprob == pytest.approx(torch.log_softmax(logits, -1)[0, 9].item())


def test_a_banned_token_is_never_sampled():
    freq = frequencies([0.5, 0.3, 0.2], num_draws=2000, logit_bias={0: -100.0})
    assert 0 not in freq and freq[1] == pytest.approx(0.6, abs=0.04)


def test_a_requests_bias_is_kept_between_steps_and_rebuilt_for_a_new_request_of_that_id():
    logits = random_logits(1, seed=9)
    sampler = Sampler()
    first = make_seq(seed=None, temperature=0.0, logit_bias={11: 100.0})
    assert sampler(logits, [first]).token_ids == [11]
    assert sampler(logits, [first]).token_ids == [11]  # from the tensors built at its first step
    again = make_seq(seed=None, temperature=0.0, logit_bias={12: 100.0})  # same request id, new request
    assert again.request_id == first.request_id
    assert sampler(logits, [again]).token_ids == [12]


def test_a_row_ahead_of_its_sequence_samples_as_the_sequence_would_there():
    """n-gram speculation: a row after k draft tokens draws the noise of output index
    num_output_tokens + k, and min_tokens counts the drafts, as for the sequence k tokens on."""
    logits = random_logits(4, seed=3)
    logits[:, EOS] = 50.0  # EOS wins wherever it is allowed
    seq = make_seq(seed=9, output=[11, 12], temperature=1.0, min_tokens=4)
    drafts = [13, 14]
    ahead = Sampler()(logits[:3], [seq, seq, seq], drafts=[[], drafts[:1], drafts]).token_ids
    for k in range(3):
        further = make_seq(seed=9, output=[11, 12, *drafts[:k]], temperature=1.0, min_tokens=4)
        assert ahead[k] == Sampler()(logits[k : k + 1], [further]).token_ids[0]
    assert EOS not in ahead[:2] and ahead[2] == EOS  # index 4 is the first that may stop
    noise = race_noise([seq, seq], VOCAB, torch.device("cpu"), ahead=[0, 2])
    assert torch.equal(noise[1], race_noise([make_seq(seed=9, output=[11, 12, 13, 14])], VOCAB, torch.device("cpu"))[0])


def test_a_row_ahead_counts_its_drafts_in_its_penalties():
    logits = random_logits(3, seed=4)
    params = dict(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.3)
    seq = make_seq(seed=2, output=[11, 12], **params)
    logits[:, 13] = logits[:, 14] = logits.max() + 0.5  # the drafts' tokens lead until penalised
    drafts = [13, 13]
    sampler = Sampler()
    penalised = sampler._penalties.apply(logits, [seq, seq, seq], [[], drafts[:1], drafts])
    for k in range(3):
        further = make_seq(seed=2, output=[11, 12, *drafts[:k]], **params)
        assert torch.equal(penalised[k], Sampler()._penalties.apply(logits[k : k + 1], [further])[0])
    # The sequence's own statistics are untouched by its rows' drafts: the next step starts from them.
    assert torch.equal(sampler._penalties.apply(logits[:1], [seq])[0], penalised[0])
    assert sampler(logits, [seq, seq, seq], drafts=[[], drafts[:1], drafts]).token_ids[0] in (13, 14)
