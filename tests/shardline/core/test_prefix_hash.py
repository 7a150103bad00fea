"""Block hashes name the same block in every process: the KV transfer and prefix routing rely on it."""

from __future__ import annotations

import os
import subprocess
import sys

from shardline.core.prefix_hash import hash_block_tokens

_CHAIN = "from shardline.core.prefix_hash import hash_block_tokens as h; print(h(h(None, range(16)), [7] * 16))"


def _chain_in_process(hash_seed: str) -> int:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    out = subprocess.run([sys.executable, "-c", _CHAIN], env=env, capture_output=True, text=True, check=True)
    return int(out.stdout)


def test_a_chain_hashes_alike_in_processes_with_different_hash_seeds():
    here = hash_block_tokens(hash_block_tokens(None, list(range(16))), [7] * 16)
    assert _chain_in_process("1") == _chain_in_process("2") == here


def test_the_hash_of_a_block_is_pinned_so_that_workers_of_other_releases_agree():
    # A change of algorithm would make every worker of an older release miss every transferred
    # block: it must be a deliberate change of this value, and of the KV transfer's layout.
    assert hash_block_tokens(None, [1, 2, 3, 4]) == hash_block_tokens(None, (1, 2, 3, 4))
    assert hash_block_tokens(None, [1, 2, 3, 4]) == 9121524398691793932
