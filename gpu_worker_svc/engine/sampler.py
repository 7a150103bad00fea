"""Batched, seed-deterministic token sampling.

The random draw of a row is a pure function of (seed, token index), and every
step after it is row-wise. So a row's token never depends on the other rows of
the batch, nor on the step, and a request resumed on another worker from a
prefix of its output continues exactly as an unbroken run would.
"""

from dataclasses import dataclass

import torch

from gpu_worker_svc.engine.penalties import PenaltyState, param_column
from gpu_worker_svc.engine.sequence import Sequence

_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int  # the sampled token
    logprob: float  # its log-probability under the raw logits
    top: list[tuple[int, float]]  # the top N (token id, logprob), most likely first


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one sampled token per row
    logprobs: list[TokenLogprobs | None]  # per row; None where none were asked


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN_GAMMA) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform_draw(seed: int, token_index: int) -> float:
    """A uniform float in (0, 1) that depends only on (seed, token_index).

    Plain integer arithmetic, so it is identical on every device and process.
    52 bits keep (k + 0.5) / 2**52 exactly representable, hence strictly < 1.
    """
    bits = _splitmix64(_splitmix64(seed & _MASK64) ^ (token_index & _MASK64)) >> 12
    return (bits + 0.5) / (1 << 52)


class Sampler:
    """Turns a step's logits into one token per sequence.

    Keep one instance per engine: it caches penalty statistics between steps.
    """

    def __init__(self) -> None:
        self._penalties = PenaltyState()

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(
                f"logits must be [{len(seqs)}, vocab], got {list(logits.shape)}"
            )
        logits = logits.float()
        # Logprobs describe the model's own distribution, so they are taken
        # before penalties and temperature reshape it.
        lp_rows = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
        raw_logprobs = None
        if lp_rows:
            raw_logprobs = torch.log_softmax(select_rows(logits, lp_rows), dim=-1)

        logits = self._penalties.apply(logits, seqs)
        logits = _mask_early_stops(logits, seqs)

        sampled_rows = [i for i, seq in enumerate(seqs) if not seq.params.is_greedy]
        if len(sampled_rows) < len(seqs):
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        if sampled_rows:
            token_ids[_index(sampled_rows, logits)] = _sample(select_rows(logits, sampled_rows),
                                                             [seqs[i] for i in sampled_rows])

        token_list = token_ids.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(seqs)
        if raw_logprobs is not None:
            lp_seqs = [seqs[i] for i in lp_rows]
            lp_tokens = [token_list[i] for i in lp_rows]
            for i, entry in zip(lp_rows, _gather_logprobs(raw_logprobs, lp_tokens, lp_seqs)):
                logprobs[i] = entry
        return SamplerOutput(token_ids=token_list, logprobs=logprobs)


def _index(rows: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=like.device)


def select_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows] for ascending distinct `rows`; t itself, with no [B, vocab] copy, when they are all of it."""
    return t if len(rows) == t.shape[0] else t[_index(rows, t)]


def _mask_early_stops(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Forbid EOS and stop ids until min_tokens output tokens exist."""
    vocab = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for i, seq in enumerate(seqs):
        params = seq.params
        if seq.num_output_tokens >= params.min_tokens:
            continue
        stop_ids = list(params.stop_token_ids)
        if seq.eos_token_id is not None and not params.ignore_eos:
            stop_ids.append(seq.eos_token_id)
        # An id past the vocabulary can never be sampled, so needs no mask.
        stop_ids = [t for t in stop_ids if t < vocab]
        rows.extend([i] * len(stop_ids))
        cols.extend(stop_ids)
    if not rows:
        return logits
    logits = logits.clone()
    logits[_index(rows, logits), _index(cols, logits)] = float("-inf")
    return logits


def _sample(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then an inverse-CDF draw per row.

    Every filter keeps a prefix of the row's tokens sorted by probability, so
    each is a per-row cutoff length and the draw is a search in the kept prefix.
    """
    for seq in seqs:
        if seq.params.seed is None:
            raise ValueError(f"request {seq.request_id!r} has no seed to sample with")
    device = logits.device
    num_rows, vocab = logits.shape
    params = [seq.params for seq in seqs]
    probs = torch.softmax(logits / param_column([p.temperature for p in params], logits), dim=-1)
    # Stable, so equal probabilities keep token-id order on every device.
    sorted_probs, sorted_ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    cdf = torch.cumsum(sorted_probs, dim=-1, dtype=torch.float64)

    # Rows without a filter keep the whole vocabulary whatever other rows ask,
    # so a row's cutoff never depends on the rest of the batch.
    keep = torch.full((num_rows,), vocab, dtype=torch.long, device=device)
    if any(p.top_k > 0 for p in params):
        top_k = _index([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], logits)
        keep = torch.minimum(keep, top_k)
    if any(p.top_p < 1.0 for p in params):
        # The nucleus is measured against the mass left after top-k.
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=device)
        mass = cdf.gather(1, (keep - 1).unsqueeze(1)).squeeze(1)
        nucleus = (cdf < (top_p * mass).unsqueeze(1)).sum(dim=-1) + 1
        keep = torch.where(top_p < 1.0, torch.minimum(keep, nucleus), keep)
    if any(p.min_p > 0.0 for p in params):
        min_p = param_column([p.min_p for p in params], logits)
        above = (sorted_probs >= min_p * sorted_probs[:, :1]).sum(dim=-1)
        keep = torch.where(min_p.squeeze(1) > 0.0, torch.minimum(keep, above), keep)

    u = torch.tensor(
        [uniform_draw(seq.params.seed, seq.num_output_tokens) for seq in seqs],
        dtype=torch.float64,
        device=device,
    )
    last_kept = (keep - 1).unsqueeze(1)
    position = torch.searchsorted(cdf, u.unsqueeze(1) * cdf.gather(1, last_kept), right=True)
    # u * mass can round up to the mass itself; stay inside the kept prefix.
    position = torch.minimum(position, last_kept)
    return sorted_ids.gather(1, position).squeeze(1)


def _gather_logprobs(
    raw_logprobs: torch.Tensor, token_ids: list[int], seqs: list[Sequence]
) -> list[TokenLogprobs]:
    """The sampled token's logprob and the top N of each row of raw_logprobs."""
    chosen_ids = torch.tensor(token_ids, device=raw_logprobs.device).unsqueeze(1)
    chosen = raw_logprobs.gather(1, chosen_ids).squeeze(1).tolist()
    num_top = min(max(seq.params.logprobs or 0 for seq in seqs), raw_logprobs.shape[1])
    top_values: list[list[float]] = [[] for _ in seqs]
    top_ids: list[list[int]] = [[] for _ in seqs]
    if num_top > 0:
        values, ids = torch.topk(raw_logprobs, num_top, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    result = []
    for i, seq in enumerate(seqs):
        n = seq.params.logprobs or 0
        top = list(zip(top_ids[i][:n], top_values[i][:n], strict=True))
        result.append(TokenLogprobs(token_id=token_ids[i], logprob=chosen[i], top=top))
    return result
