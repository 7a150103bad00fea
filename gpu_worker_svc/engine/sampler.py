"""Batched, seed-deterministic token sampling.

The random draw of a row is a pure function of (seed, token index), and every
step after it is row-wise. So a row's token never depends on the other rows of
the batch, nor on the step, and a request resumed on another worker from a
prefix of its output continues exactly as an unbroken run would.

The draw is an exponential race, as in vLLM: each token gets its own Exp(1)
noise E, keyed by token id, and the token with the largest p / E wins, which
picks token i with probability p_i. An inverse-CDF draw over the sorted
probabilities picks the same way in theory, but in float32 the logits of one
request differ by ~1e-5 between batch shapes (the GEMMs reduce in other orders),
and in the long flat tail of a vocabulary that is enough to reorder tokens and
shift the running sum: in a test with 30% of the mass spread over 1,000 tokens,
1e-5 of jitter changed 371 of 2,000 seeded draws (most of those that landed in
the tail), and a reviewer saw one seed give two texts under load. The race
changed none: it changes its pick only if its two best scores lie within the
jitter of each other.
"""

from dataclasses import dataclass

import torch

from gpu_worker_svc.engine.grammar import mask_logits
from gpu_worker_svc.engine.outputs import TokenLogprobs
from gpu_worker_svc.engine.penalties import PenaltyState, param_column
from gpu_worker_svc.engine.sequence import Sequence

_MASK64 = (1 << 64) - 1
# Tokens a top-p row looks among before it sorts its whole vocabulary.
_NUCLEUS_HEAD = 1024
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one sampled token per row
    logprobs: list[TokenLogprobs | None]  # per row; None where none were asked


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN_GAMMA) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_key(seed: int, token_index: int) -> int:
    """The 64-bit key of a row's random draw: a function of (seed, token_index) alone."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (token_index & _MASK64))


def race_noise(seqs: list[Sequence], vocab: int, device: torch.device, ahead: list[int] | None = None) -> torch.Tensor:
    """Exp(1) noise [rows, vocab], indexed by token id; row r a pure function of its (seed, token index).

    Row r draws for output index seqs[r].num_output_tokens + ahead[r] (ahead: see Sampler.__call__).

    Each row comes from a generator seeded with its key, on the logits' device (so a CUDA worker
    draws other noise than a CPU one for the same seed: pools are of one kind).
    """
    noise = torch.empty(len(seqs), vocab, device=device)
    generator = torch.Generator(device=device)
    for row, seq, k in zip(noise, seqs, ahead or [0] * len(seqs)):
        seed = seq.params.seed
        assert seed is not None  # the engine gives every request one when it is added
        key = draw_key(seed, seq.num_output_tokens + k)
        generator.manual_seed((key ^ (key >> 32)) & 0xFFFFFFFF)  # CPU's mt19937 keeps 32 bits: fold all 64 in
        row.uniform_(generator=generator)
    return noise.log_().neg_()  # a uniform 0 gives infinite noise: that token cannot win


class Sampler:
    """Turns a step's logits into one token per sequence.

    Keep one instance per engine: it caches penalty statistics and logit biases between steps.
    """

    def __init__(self) -> None:
        self._penalties = PenaltyState()
        self._logit_bias = LogitBias()

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]] | None = None
    ) -> SamplerOutput:
        """One token per row. `drafts[r]`: draft tokens that row r follows beyond its sequence's
        output (n-gram speculation). The row samples as the sequence would with them appended: its
        output index, random draw, min_tokens, penalties and grammar mask count them."""
        _check_rows(logits, seqs)
        lp_rows = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
        # Logprobs describe the model's own distribution, so they are taken
        # before penalties and temperature reshape it.
        raw_logprobs = torch.log_softmax(select_rows(logits.float(), lp_rows), dim=-1) if lp_rows else None
        token_list = self.token_ids(logits, seqs, drafts).tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(seqs)
        if raw_logprobs is not None:
            lp_seqs = [seqs[i] for i in lp_rows]
            lp_tokens = [token_list[i] for i in lp_rows]
            for i, entry in zip(
                lp_rows, token_logprobs(raw_logprobs, lp_tokens, [seq.params.logprobs or 0 for seq in lp_seqs])
            ):
                logprobs[i] = entry
        return SamplerOutput(token_ids=token_list, logprobs=logprobs)

    def token_ids(
        self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]] | None = None
    ) -> torch.Tensor:
        """The sampled token of each row, [rows] long, left on the logits' device (no wait for it)."""
        _check_rows(logits, seqs)
        ahead = [len(d) for d in drafts] if drafts is not None else None
        logits = logits.float()
        if drafts is None and all(_plain_greedy(seq) for seq in seqs):
            # The common batch: nothing reshapes a logit, so each token is its row's argmax. One check
            # per row instead of one pass per option (~0.1 ms a step at batch 64 on this CPU).
            self._logit_bias.forget()
            self._penalties.forget()
            return logits.argmax(dim=-1)

        logits = self._logit_bias.apply(logits, seqs)
        logits = self._penalties.apply(logits, seqs, drafts)
        # Structured output: after the biases, so none re-allows a token.
        logits = mask_logits(logits, [seq.grammar for seq in seqs], drafts)
        logits = _mask_early_stops(logits, seqs, ahead)

        sampled_rows = [i for i, seq in enumerate(seqs) if not seq.params.is_greedy]
        if len(sampled_rows) < len(seqs):
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        if sampled_rows:
            token_ids[_index(sampled_rows, logits)] = _sample(
                select_rows(logits, sampled_rows),
                [seqs[i] for i in sampled_rows],
                [ahead[i] for i in sampled_rows] if ahead is not None else None,
            )
        return token_ids


def _plain_greedy(seq: Sequence) -> bool:
    p = seq.params
    return (
        p.is_greedy
        and not p.logit_bias
        and not p.has_penalties
        and seq.grammar is None
        and seq.num_output_tokens >= p.min_tokens
    )


def _check_rows(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(seqs):
        raise ValueError(f"logits must be [{len(seqs)}, vocab], got {list(logits.shape)}")


def _index(rows: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=like.device)


def select_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows] for ascending distinct `rows`; t itself, with no [B, vocab] copy, when they are all of it."""
    return t if len(rows) == t.shape[0] else t[_index(rows, t)]


class LogitBias:
    """Adds each row's logit_bias to its logits, all rows in one op per step (before penalties, as vLLM).

    A request's bias is turned into (token ids, values) tensors once, when it first comes, not per
    step: a bias over the whole vocabulary (49k entries) took 21 ms per row per step from the dict.
    """

    def __init__(self) -> None:
        self._rows: dict[str, tuple[Sequence, torch.Tensor, torch.Tensor]] = {}

    def forget(self) -> None:
        """A step without biases: none is kept for the next."""
        self._rows = {}

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        biased = [(i, self._tensors(seq, logits)) for i, seq in enumerate(seqs) if seq.params.logit_bias]
        self._rows = {seqs[i].request_id: (seqs[i], *pair) for i, pair in biased}
        if not biased:
            return logits
        rows = torch.cat([torch.full_like(ids, i) for i, (ids, _) in biased])
        cols = torch.cat([ids for _, (ids, _) in biased])
        values = torch.cat([v for _, (_, v) in biased])
        return logits.index_put((rows, cols), values, accumulate=True)

    def _tensors(self, seq: Sequence, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cached = self._rows.get(seq.request_id)
        if cached is not None and cached[0] is seq:
            return cached[1], cached[2]
        # An id past the vocabulary can never be sampled anyway.
        pairs = [(t, b) for t, b in seq.params.logit_bias.items() if t < like.shape[1]]
        ids = torch.tensor([t for t, _ in pairs], dtype=torch.long, device=like.device)
        return ids, torch.tensor([b for _, b in pairs], dtype=like.dtype, device=like.device)


def _mask_early_stops(logits: torch.Tensor, seqs: list[Sequence], ahead: list[int] | None = None) -> torch.Tensor:
    """Forbid EOS and stop ids until min_tokens output tokens exist."""
    vocab = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for i, seq in enumerate(seqs):
        params = seq.params
        if seq.num_output_tokens + (ahead[i] if ahead is not None else 0) >= params.min_tokens:
            continue
        stop_ids = list(params.stop_token_ids)
        # A grammar's EOS ends its request even under ignore_eos, so it is held back all the same.
        if seq.eos_token_id is not None and (not params.ignore_eos or seq.grammar is not None):
            stop_ids.append(seq.eos_token_id)
        # An id past the vocabulary can never be sampled, so needs no mask.
        stop_ids = [t for t in stop_ids if t < vocab]
        if seq.grammar is not None and not _allows_other_tokens(logits[i], stop_ids):
            continue  # a complete structured output may only end: its grammar allows EOS alone
        rows.extend([i] * len(stop_ids))
        cols.extend(stop_ids)
    if not rows:
        return logits
    logits = logits.clone()
    logits[_index(rows, logits), _index(cols, logits)] = float("-inf")
    return logits


def _allows_other_tokens(row: torch.Tensor, stop_ids: list[int]) -> bool:
    """Some token outside `stop_ids` has a finite logit in `row`."""
    allowed = torch.isfinite(row)
    allowed[stop_ids] = False
    return bool(allowed.any())


def _sample(logits: torch.Tensor, seqs: list[Sequence], ahead: list[int] | None = None) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then an exponential race per row (see the module docstring).

    Each filter keeps the row's most likely tokens, so the kept set is a mask over token ids. Only
    rows with top-p sort their probabilities: a full sort of the vocabulary cost more than the rest
    of the sampler together (~40 ms for 16 rows on a 2-core CPU), and the race needs none.
    """
    for seq in seqs:
        if seq.params.seed is None:
            raise ValueError(f"request {seq.request_id!r} has no seed to sample with")
    params = [seq.params for seq in seqs]
    probs = torch.softmax(logits / param_column([p.temperature for p in params], logits), dim=-1)
    # Rows without a filter keep every token of nonzero probability whatever other rows ask, so a
    # row's kept set never depends on the rest of the batch. A token of probability 0 (masked, or
    # underflowed) scores 0 in the race, as does a likely one whose noise is infinite (a uniform
    # draw of exactly 0): kept, the first of them could win the argmax, a token the grammar forbids.
    kept = probs > 0
    if any(p.top_k > 0 for p in params):
        _keep_top(kept, probs, [p.top_k for p in params])
    if any(p.top_p < 1.0 for p in params):
        _keep_nucleus(kept, probs, [p.top_p for p in params])
    if any(p.min_p > 0.0 for p in params):
        min_p = param_column([p.min_p for p in params], logits)
        kept &= probs >= min_p * probs.amax(dim=-1, keepdim=True)
    score = probs / race_noise(seqs, probs.shape[1], probs.device, ahead)
    return score.masked_fill_(~kept, -1.0).argmax(dim=-1)


def _keep_top(kept: torch.Tensor, probs: torch.Tensor, top_k: list[int]) -> None:
    """Narrows each row with top_k > 0 to its top_k most likely tokens (equal ones in topk's order)."""
    rows = [i for i, n in enumerate(top_k) if n > 0]
    index = _index(rows, probs)
    k = [min(top_k[i], probs.shape[1]) for i in rows]
    _, ids = probs[index].topk(max(k), dim=-1)
    _keep_first(kept, index, ids, _index(k, probs).unsqueeze(1))


def _keep_nucleus(kept: torch.Tensor, probs: torch.Tensor, top_p: list[float]) -> None:
    """Narrows each row with top_p < 1 to its most likely tokens whose mass first reaches top_p
    of the mass still kept (the nucleus is measured after top-k, as before it)."""
    rows = [i for i, p in enumerate(top_p) if p < 1.0]
    index = _index(rows, probs)
    candidates = torch.where(kept[index], probs[index], 0.0)
    need = torch.tensor([top_p[i] for i in rows], dtype=torch.float64, device=probs.device) * candidates.sum(
        dim=-1, dtype=torch.float64
    )
    # A nucleus is most often a few hundred tokens: look among the likeliest first, and sort the
    # whole vocabulary only when they fall short (a full sort is most of the cost here).
    head, head_ids = candidates.topk(min(_NUCLEUS_HEAD, candidates.shape[1]), dim=-1)
    cdf = torch.cumsum(head, dim=-1, dtype=torch.float64)
    if bool((cdf[:, -1] < need).any()):
        # Stable, so equal probabilities keep token-id order on every device.
        head, head_ids = torch.sort(candidates, dim=-1, descending=True, stable=True)
        cdf = torch.cumsum(head, dim=-1, dtype=torch.float64)
    _keep_first(kept, index, head_ids, (cdf < need.unsqueeze(1)).sum(dim=-1, keepdim=True) + 1)


def _keep_first(kept: torch.Tensor, index: torch.Tensor, ordered_ids: torch.Tensor, counts: torch.Tensor) -> None:
    """Narrows rows `index` of `kept` to the first counts[r] ([n, 1]) token ids of ordered_ids[r]."""
    first = torch.arange(ordered_ids.shape[1], device=kept.device) < counts
    kept[index] &= torch.zeros_like(kept[index]).scatter_(1, ordered_ids, first)


def token_logprobs(raw_logprobs: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprobs]:
    """Row i's logprob of token_ids[i], and its num_top[i] most likely tokens, from log-softmaxed rows."""
    chosen_ids = torch.tensor(token_ids, device=raw_logprobs.device).unsqueeze(1)
    chosen_column = raw_logprobs.gather(1, chosen_ids)
    chosen = chosen_column.squeeze(1).tolist()
    ranks = (raw_logprobs >= chosen_column).sum(dim=1).tolist()  # one pass over the rows, for all of them
    most = min(max(num_top, default=0), raw_logprobs.shape[1])
    top_values: list[list[float]] = [[] for _ in token_ids]
    top_ids: list[list[int]] = [[] for _ in token_ids]
    if most > 0:
        values, ids = torch.topk(raw_logprobs, most, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    return [
        TokenLogprobs(
            token_id=token_ids[i],
            logprob=chosen[i],
            rank=ranks[i],
            top=list(zip(top_ids[i][:n], top_values[i][:n], strict=True)),
        )
        for i, n in enumerate(num_top)
    ]
