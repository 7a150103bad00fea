"""A text is refused by its size before it is tokenized: the bound never passes the real count, and a
3 MB prompt leaves a real tokenizer process's memory where it was."""

from __future__ import annotations

import random
from pathlib import Path

import grpc
import pytest
from tokenizers import normalizers

from shardline.core.ports import free_port
from shardline.core.text.tokenizer import Tokenizer
from shardline.proto import sampling_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from tests.gateway.conftest import start_tokenizer
from tokenizer_svc.prompt_size import PromptSize

CONTEXT = 8192  # the default model's


def _texts(tokenizer: Tokenizer, corpus: list[str]) -> list[str]:
    """The corpus, runs of the vocabulary's longest tokens (where the bound is tight), and random text."""
    longest = max(range(tokenizer.vocab_size), key=lambda i: len(tokenizer.token_bytes([i])))
    rng = random.Random(7)
    alphabet = "ab é中😀\n\t-=_.0" + "".join(chr(c) for c in range(0x300, 0x310))
    return [
        *(text * 50 for text in corpus),
        tokenizer.decode([longest], skip_special_tokens=False) * 200,
        " " * 20_000,
        "-" * 20_000,
        "\n" * 20_000,
        *("".join(rng.choice(alphabet) for _ in range(5_000)) for _ in range(5)),
    ]


@pytest.mark.parametrize("name", ["tokenizer", "spm_tokenizer"])
def test_the_lower_bound_never_passes_the_real_count(request, name, corpus) -> None:
    tokenizer: Tokenizer = request.getfixturevalue(name)
    size = PromptSize(tokenizer, CONTEXT)
    texts = _texts(tokenizer, corpus)
    for text, ids in zip(texts, tokenizer.encode_batch(texts, add_special_tokens=False)):
        assert size.min_tokens(text) <= len(ids), text[:40]
    assert size.min_tokens(texts[-1]) > 0


def test_with_a_normalizer_the_text_is_measured_as_normalized(spm_gguf: Path, corpus) -> None:
    # NFC makes 3 code points of one, StripAccents drops them all: the raw length would overshoot.
    tokenizer = Tokenizer.from_model_path(spm_gguf)
    tokenizer.backend.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.StripAccents()])
    size = PromptSize(tokenizer, CONTEXT)
    texts = ["e\u0301\u0302\u0303" * 30_000, "\u1100\u1161\u11a8" * 30_000, *_texts(tokenizer, corpus)]
    for text, ids in zip(texts, tokenizer.encode_batch(texts, add_special_tokens=False)):
        assert size.min_tokens(text) <= len(ids), text[:40]


def test_only_a_text_that_surely_passes_the_context_has_a_problem(tokenizer) -> None:
    size = PromptSize(tokenizer, CONTEXT)
    assert size.longest_token == 81  # bytes: the default vocabulary's longest token
    assert size.problem("word " * 1000) is None
    assert size.problem("x" * (CONTEXT * 81)) is None  # as long as CONTEXT of the longest tokens: may fit
    problem = size.problem("word " * 600_000)
    assert problem is not None and problem.startswith("has at least 37038 tokens (3000000 bytes")


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.slow
def test_3_mb_prompts_leave_the_tokenizers_memory_within_100_mb() -> None:
    port = free_port()
    process = start_tokenizer(port)
    try:
        with grpc.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64 << 20)]
        ) as channel:
            stub = tokenizer_pb2_grpc.TokenizerStub(channel)
            stub.Tokenize(tokenizer_pb2.TokenizeRequest(texts=["warm up " * 100]), timeout=30)
            before = _rss_bytes(process.pid)
            prose = ("The quick brown fox jumps over the lazy dog. " * 70_000)[:3_000_000]
            cjk = "中文测试你好世界" * 125_000  # 3 MB of UTF-8, a token or so per character
            for text in (prose, cjk) * 6:
                with pytest.raises(grpc.RpcError) as caught:
                    stub.Tokenize(tokenizer_pb2.TokenizeRequest(texts=[text]), timeout=30)
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert caught.value.details().startswith("texts[0]: has at least")
                chat = tokenizer_pb2.ApplyChatTemplateRequest(
                    messages=[sampling_pb2.ChatMessage(role="user", content=text)], add_generation_prompt=True
                )
                with pytest.raises(grpc.RpcError) as caught:
                    stub.ApplyChatTemplate(chat, timeout=30)
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert caught.value.details().startswith("messages: has at least")
            grown = _rss_bytes(process.pid) - before
            assert grown < 100 << 20, f"RSS grew by {grown >> 20} MB"
            # A prompt that fits is still tokenized.
            reply = stub.Tokenize(tokenizer_pb2.TokenizeRequest(texts=[prose[:20_000]]), timeout=30)
            assert 1000 < len(reply.token_ids[0].ids) < CONTEXT
    finally:
        process.terminate()
        process.wait(timeout=30)
