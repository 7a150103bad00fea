"""Which worker gets a request: least-loaded, with prefix affinity."""

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler_svc.live_request import LiveRequest
from scheduler_svc.worker_registry import RegisteredWorker
from shardline.core.prefix_hash import chain_root, hash_block_tokens

# Used when a worker registers without a block size.
DEFAULT_BLOCK_SIZE = 16


def prefix_hashes(prompt: Sequence[int], block_size: int, max_blocks: int, root: int | None = None) -> list[int]:
    """Chained hashes of the prompt's first full blocks, as the engine's prefix cache computes them;
    `root`: what the first chains from (a LoRA adapter's, so its prefixes are remembered apart)."""
    hashes: list[int] = []
    parent = root
    for start in range(0, min(len(prompt) // block_size, max_blocks) * block_size, block_size):
        parent = hash_block_tokens(parent, prompt[start : start + block_size])
        hashes.append(parent)
    return hashes


@dataclass(slots=True, frozen=True)
class Route:
    """Where a request goes, and what the router knew of that worker's cache before sending it there."""

    worker: RegisteredWorker
    # Leading prompt tokens (whole blocks) that the router last sent to this worker: what its prefix
    # cache likely holds, unless it evicted them since. 0 for a prefix it never saw there.
    cached_tokens: int


def _rendezvous_score(key: int, worker_id: str) -> int:
    digest = hashlib.blake2b(key.to_bytes(8, "little") + worker_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class Router:
    """Picks a worker for each request.

    A request reuses the KV blocks of an earlier one with the same prompt
    prefix only on the worker that computed them. So the router remembers, per
    prefix hash (the engine's own chained block hash), the worker that last
    served it, and sends a request to the worker behind its longest remembered
    prefix. Balance wins over affinity when that worker's load exceeds the
    least-loaded candidate's by more than `load_slack`. A prefix never seen
    goes to the near-least-loaded worker that rendezvous hashing of its first
    block picks, so identical cold prefixes still meet on one worker.

    Affinity looks at the first `max_prefix_blocks` blocks; the whole prompt's chain, up to
    `max_known_blocks`, is remembered too, so that the scheduler can tell how much of a long prompt
    the chosen worker likely holds (Route.cached_tokens: whether to prefill it remotely).
    """

    def __init__(
        self, load_slack: float, max_prefix_blocks: int = 4, max_entries: int = 262_144, max_known_blocks: int = 512
    ) -> None:
        self._load_slack = load_slack
        self._max_prefix_blocks = max_prefix_blocks
        self._max_known_blocks = max(max_known_blocks, max_prefix_blocks)
        self._max_entries = max_entries
        # prefix hash -> worker that last served it, least recently used first.
        self._last_served: OrderedDict[int, str] = OrderedDict()

    def choose(self, request: LiveRequest, candidates: Sequence[RegisteredWorker]) -> RegisteredWorker:
        """The worker for `request`, among non-empty `candidates` (all with room)."""
        return self.route(request, candidates).worker

    def route(self, request: LiveRequest, candidates: Sequence[RegisteredWorker]) -> Route:
        """The worker for `request` among non-empty `candidates` (all with room), and how much of its
        prompt that worker was last sent."""
        # One pool serves one model, whose workers share a block size.
        block_size = candidates[0].info.block_size or DEFAULT_BLOCK_SIZE
        # A LoRA adapter's request computes other KV than the model's: its prefixes are its own.
        root = chain_root(request.model) if request.model in candidates[0].info.adapters else None
        chain = prefix_hashes(request.prompt_token_ids, block_size, self._max_known_blocks, root)
        hashes = chain[: self._max_prefix_blocks]
        min_load = min(worker.load for worker in candidates)
        eligible = {w.worker_id: w for w in candidates if w.load <= min_load + self._load_slack}
        chosen = self._affine(hashes, eligible)
        if chosen is None:
            if hashes:
                chosen = max(eligible.values(), key=lambda w: _rendezvous_score(hashes[0], w.worker_id))
            else:
                # Too short to share a block: plain least-loaded, ties spread by the id.
                key = int.from_bytes(hashlib.blake2b(request.request_id.encode(), digest_size=8).digest(), "little")
                chosen = min(candidates, key=lambda w: (w.load, -_rendezvous_score(key, w.worker_id)))
        known = self._known_blocks(chain, chosen.worker_id)
        self._remember(chain, chosen.worker_id)
        return Route(chosen, known * block_size)

    def _known_blocks(self, chain: list[int], worker_id: str) -> int:
        """How many leading blocks of `chain` were last sent to `worker_id`."""
        for count in range(len(chain), 0, -1):
            if self._last_served.get(chain[count - 1]) == worker_id:
                return count
        return 0

    def _affine(self, hashes: list[int], eligible: dict[str, RegisteredWorker]) -> RegisteredWorker | None:
        for prefix_hash in reversed(hashes):
            worker = eligible.get(self._last_served.get(prefix_hash, ""))
            if worker is not None:
                return worker
        return None

    def _remember(self, hashes: list[int], worker_id: str) -> None:
        for prefix_hash in hashes:
            self._last_served[prefix_hash] = worker_id
            self._last_served.move_to_end(prefix_hash)
        while len(self._last_served) > self._max_entries:
            self._last_served.popitem(last=False)
