"""`shardline generate` / `chat`: bad values and failures are one line and an exit code, never a traceback."""

from __future__ import annotations

import pytest

from shardline.cli.main import main
from shardline.client.types import build_request


@pytest.mark.parametrize("flags", [["--max-tokens", "0"], ["--temperature", "-1"], ["--top-p", "2"], ["--tp", "0"]])
def test_out_of_range_flags_are_usage_errors(flags, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["generate", "hi", *flags])
    assert exited.value.code == 2 and flags[0] in capsys.readouterr().err


def test_failures_are_one_line(capsys):
    assert main(["generate", "hi", "--model", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardline generate: /nonexistent: model path not found") and "Traceback" not in err
    assert main(["generate", "hi", "--url", "127.0.0.1:1", "--max-tokens", "2"]) == 1
    assert capsys.readouterr().err.startswith("shardline generate: UNAVAILABLE: ")


def test_sdk_request_building_takes_what_callers_pass():
    req = build_request("hi", stop_token_ids=198, stop="x", seed=-1, timeout=0.0004)
    assert list(req.params.stop_token_ids) == [198] and list(req.params.stop) == ["x"]
    assert req.params.seed == 2**64 - 1  # a signed seed, as OpenAI's, keeps its bits
    assert req.timeout.ToMilliseconds() == 1  # rounded up, never a zero deadline
    assert dict(build_request("hi", logit_bias={"5": -100, 7: 2.5}).params.logit_bias) == {5: -100.0, 7: 2.5}
    developer = build_request(
        messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    )
    assert [m.role for m in developer.messages.messages] == ["system", "user"]
    with pytest.raises(ValueError, match="timeout"):
        build_request("hi", timeout=0)
    slo = build_request("hi", ttft_target=0.25, refuse_late=True)
    assert slo.ttft_target.ToMilliseconds() == 250 and slo.refuse_late and slo.HasField("refuse_late")
    assert not build_request("hi").HasField("ttft_target") and not build_request("hi").HasField("refuse_late")
    with pytest.raises(ValueError, match="ttft_target"):
        build_request("hi", ttft_target=-1)


def test_bad_worker_settings_are_one_line(monkeypatch, capsys):
    # In-process, the engine is the one a worker runs, from the same SHARDLINE_* variables.
    monkeypatch.setenv("SHARDLINE_NUM_SPECULATIVE_TOKENS", "many")
    assert main(["generate", "hi", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardline generate: bad settings: SHARDLINE_NUM_SPECULATIVE_TOKENS") and err.count("\n") == 1


def test_in_process_generation_runs_the_workers_engine(monkeypatch, capsys):
    """Greedy text from the real model, in-process; with the worker's speculation setting on, the
    same text (drafts never change greedy tokens), from an engine that drafted."""
    from shardline.cli import local_generator

    engines, accepted = [], []
    build_engine = local_generator.build_engine

    def build(settings):
        engine = build_engine(settings)
        step = engine.step

        def counted_step():
            out = step()
            accepted.append(out.stats.num_accepted_tokens if out.stats else 0)
            return out

        engine.step = counted_step
        engines.append(engine)
        return engine

    monkeypatch.setattr(local_generator, "build_engine", build)
    args = ["generate", "Count: 1, 2, 3, 4, 5,", "--max-tokens", "12", "--temperature", "0"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert plain.strip().startswith("6, 7") and sum(accepted) == 0
    monkeypatch.setenv("SHARDLINE_NUM_SPECULATIVE_TOKENS", "4")
    assert main(args) == 0
    assert capsys.readouterr().out == plain
    assert [e.config.speculative.num_speculative_tokens for e in engines] == [0, 4] and sum(accepted) > 0
