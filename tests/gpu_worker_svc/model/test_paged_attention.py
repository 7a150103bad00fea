"""Attention over the paged KV cache gives the logits of a plain full recompute, however a step is cut.

The reference is always this runtime's own single prefill of the same tokens (itself
checked against HF elsewhere), so these tests isolate the cache: slot mapping, chunk
masks, decode padding, block tables and the order of sequences in the flat batch.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
from transformers import LlamaConfig

from gpu_worker_svc.engine.model_runner import ModelRunner, RunnerConfig
from tests.gpu_worker_svc.model.paged_driver import PagedDriver
from tests.gpu_worker_svc.model.random_checkpoints import random_hf_model, random_prompts

TOL = 1e-4
VOCAB = 256
BLOCK = 16
NUM_BLOCKS = 256
SCRATCH_BLOCK = 224  # full recomputes use blocks from here on, clear of the sequences under test


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> Iterator[ModelRunner]:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    folder = tmp_path_factory.mktemp("paged-llama")
    random_hf_model(config, seed=11).save_pretrained(folder)
    threads = torch.get_num_threads()
    r = ModelRunner(RunnerConfig(model=str(folder), num_blocks=NUM_BLOCKS, block_size=BLOCK))
    # Rank 0 runs in this process and sets torch to use every core; on a shared 2-core
    # machine the second thread is often descheduled and each tiny matmul waits for it
    # (~50x slower). One thread changes nothing but speed.
    torch.set_num_threads(1)
    yield r
    r.shutdown()
    torch.set_num_threads(threads)


def recompute(runner: ModelRunner, *token_lists: list[int]) -> torch.Tensor:
    """Logits of the last token of each list, each computed by one prefill with nothing cached, [n, V]."""
    driver = PagedDriver(runner)
    driver.next_block = SCRATCH_BLOCK
    return driver.step({driver.add(tokens): len(tokens) for tokens in token_lists})


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert (ours - ref).abs().max().item() <= TOL


def test_decode_equals_full_recompute_at_every_step(runner):
    """Sequences of different lengths decode together, crossing block boundaries at different steps."""
    prompts = random_prompts(VOCAB, [1, 15, 17, 31], seed=1)
    driver = PagedDriver(runner)
    seqs = [driver.add(p) for p in prompts]
    logits = driver.step({s: len(p) for s, p in zip(seqs, prompts)})
    for _ in range(20):
        assert_close(logits, recompute(runner, *(driver.tokens[s] for s in seqs)))
        for s, row in zip(seqs, logits):
            driver.tokens[s].append(int(row.argmax()))
        logits = driver.step({s: 1 for s in seqs})


@pytest.mark.parametrize(
    "chunks", [[5, 16, 40], [16, 16, 29], [5, 1, 7, 48]], ids=["5-16-rest", "block-aligned", "with-1-token-chunk"]
)
def test_chunked_prefill_equals_single_prefill(runner, chunks):
    prompt = random_prompts(VOCAB, [sum(chunks)], seed=2)[0]
    driver = PagedDriver(runner)
    seq = driver.add(prompt)
    end = 0
    for n in chunks:
        end += n
        assert_close(driver.step({seq: n})[0], recompute(runner, prompt[:end])[0])
    # A decode after the chunks reads every chunk's cache entries.
    driver.tokens[seq].append(3)
    assert_close(driver.step({seq: 1})[0], recompute(runner, prompt + [3])[0])


def _history(driver: PagedDriver, prompts: dict[str, list[int]], done: dict[str, int]) -> dict[str, int]:
    """Adds the sequences and computes `done[name]` tokens of each, one step per sequence."""
    seqs = {name: driver.add(p) for name, p in prompts.items()}
    for name, n in done.items():
        if n:
            driver.step({seqs[name]: n})
    return seqs


@pytest.mark.parametrize("order", ["ABCD", "BADC", "DCBA", "CADB"])
def test_mixed_step_equals_each_sequence_alone(runner, order):
    """Decodes (A, D), a chunk after a cached prefix (B) and a fresh prefill (C), flat-batched in `order`."""
    tokens = random_prompts(VOCAB, [21, 40, 25, 4], seed=3)
    prompts = dict(zip("ABCD", tokens))
    done = {"A": 20, "B": 12, "C": 0, "D": 3}
    work = {"A": 1, "B": 10, "C": 25, "D": 1}

    mixed = PagedDriver(runner)
    mixed_seqs = _history(mixed, prompts, done)
    rows = dict(zip(order, mixed.step({mixed_seqs[name]: work[name] for name in order})))

    alone = PagedDriver(runner)
    alone.next_block = NUM_BLOCKS // 3  # its own blocks: the mixed driver's stay intact
    alone_seqs = _history(alone, prompts, done)
    for name in "ABCD":
        assert_close(rows[name], alone.step({alone_seqs[name]: work[name]})[0])
        assert_close(rows[name], recompute(runner, prompts[name][: done[name] + work[name]])[0])


def test_shuffled_block_tables_give_the_same_logits(runner):
    """Two sequences whose blocks are scattered and interleaved across the cache."""
    prompts = random_prompts(VOCAB, [50, 37], seed=4)
    steps = 12

    contiguous = PagedDriver(runner)
    ref_seqs = [contiguous.add(p) for p in prompts]
    shuffled = PagedDriver(runner)
    seqs = [shuffled.add(p) for p in prompts]
    ids = random.Random(5).sample(range(16, SCRATCH_BLOCK), 2 * 4)  # 4 blocks hold 50 + 12 tokens
    shuffled.tables[seqs[0]], shuffled.tables[seqs[1]] = ids[0::2], ids[1::2]
    assert shuffled.tables[seqs[0]] != sorted(shuffled.tables[seqs[0]])

    ref = contiguous.step({s: len(p) for s, p in zip(ref_seqs, prompts)})
    ours = shuffled.step({s: len(p) for s, p in zip(seqs, prompts)})
    for _ in range(steps):
        assert_close(ours, ref)
        for s, r, row in zip(seqs, ref_seqs, ref):
            tok = int(row.argmax())
            shuffled.tokens[s].append(tok)
            contiguous.tokens[r].append(tok)
        ref = contiguous.step({s: 1 for s in ref_seqs})
        ours = shuffled.step({s: 1 for s in seqs})
    assert_close(ours, ref)
