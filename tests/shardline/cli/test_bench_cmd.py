"""`shardline bench`: rounds alternate the backends, and the figures are the rounds' medians."""

from __future__ import annotations

import json
import statistics

import pytest

from shardline.bench.load import LoadSpec
from shardline.bench.metrics import RequestTiming, Slos, median_of_rounds, summarize
from shardline.cli.main import main


def _round(ttfts: list[float], wall_s: float, errors: int = 0) -> dict:
    timings = [RequestTiming(input_len=8, output_len=2, chunk_times=[t, t + 0.1]) for t in ttfts]
    timings += [RequestTiming(input_len=8, ok=False, error="boom") for _ in range(errors)]
    return summarize(timings, wall_s)


def test_median_of_rounds_takes_each_figures_median_and_totals_the_errors():
    rounds = [_round([0.1, 0.2], 1.0), _round([0.3, 0.4], 4.0, errors=1), _round([0.5, 0.6], 2.0)]
    out = median_of_rounds(rounds)
    assert out["output_throughput"] == pytest.approx(2.0)  # 4 tokens over 1, 4 and 2 s: median 2 tok/s
    assert out["ttft_ms"]["median"] == pytest.approx(350.0)  # round medians 150, 350, 550
    assert out["wall_s"] == 2.0
    # Counts compare with one round's prompts; errors are counted over all rounds.
    assert (out["completed"], out["failed"], out["errors"]) == (2, 0, {"boom": 1})
    assert out["goodput"] is None  # no SLO given: no goodput, as in vLLM
    assert "detail" not in out


def test_percentiles_and_std_are_numpys():
    numpy = pytest.importorskip("numpy")
    ttfts = [0.013, 0.5, 0.021, 0.2, 0.8, 0.05, 0.3, 0.9]
    out = _round(ttfts, 1.0)["ttft_ms"]
    values = numpy.array(ttfts) * 1000
    assert out["p99"] == pytest.approx(numpy.percentile(values, 99))  # interpolated: not simply the maximum
    assert out["std"] == pytest.approx(numpy.std(values))
    assert out["p99"] < max(values)


def test_goodput_counts_requests_meeting_every_slo_and_detail_keeps_every_request():
    timings = [
        RequestTiming(input_len=8, output_len=3, cached_tokens=4, chunk_times=[0.1, 0.15, 0.2]),
        RequestTiming(input_len=8, output_len=3, chunk_times=[0.5, 0.55, 0.6]),
        RequestTiming(input_len=8, output_len=3, chunk_times=[0.1, 0.4, 0.7]),
        RequestTiming(input_len=8, ok=False, error="boom"),
    ]
    out = summarize(timings, 2.0, Slos(ttft_ms=200, e2el_ms=650))
    assert out["goodput"] == pytest.approx(0.5)  # the first and third meet both; the second is late
    assert out["cached_prompt_tokens"] == 4
    assert [d["error"] for d in out["detail"]] == [None, None, None, "boom"]  # send order, failures kept
    assert out["detail"][2] == {
        "input_len": 8,
        "output_len": 3,
        "cached_tokens": 0,
        "ttft_ms": 100.0,
        "e2el_ms": 700.0,
        "itl_ms": [300.0, 300.0],
        "error": None,
    }


@pytest.mark.slow
def test_bench_runs_rounds_on_the_engine_and_writes_them(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                "--engine",
                "--model",
                "dummy:smollm2-135m",
                "--num-prompts",
                "2",
                "--input-len",
                "8",
                "--output-len",
                "3",
                "--rounds",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert [r["completed"] for r in report["rounds"]["engine"]] == [2, 2]
    assert report["results"]["engine"]["completed"] == 2
    assert report["comparison"] is None  # no stack to compare with
    assert "medians of 2 alternating rounds" in capsys.readouterr().out


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_arrivals_keep_the_rate_and_burstiness_sets_their_spread(burstiness):
    # Gamma-distributed gaps, as vLLM's --burstiness: the mean gap is 1 / rate whatever the shape,
    # and the gaps' coefficient of variation is 1 / sqrt(burstiness) (1 for a Poisson process).
    spec = LoadSpec(num_prompts=20_001, request_rate=50.0, burstiness=burstiness, seed=3)
    offsets = spec.arrival_offsets()
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0 and all(g >= 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(1 / 50, rel=0.05)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(burstiness**-0.5, rel=0.05)
    assert LoadSpec(num_prompts=3, burstiness=burstiness).arrival_offsets() == [0.0] * 3  # rate inf: all at once


@pytest.mark.parametrize(
    "rate, burstiness, error",
    [
        ("5", "0", "--burstiness must be a finite number above 0"),
        ("5", "-1", "--burstiness must be a finite number above 0"),
        ("5", "inf", "--burstiness must be a finite number above 0"),
        ("5", "1e308", "--burstiness must be a finite number above 0"),  # rate x burstiness overflows
        ("5", "nan", "--burstiness must be a finite number above 0"),
        ("0", "1", "--request-rate must be above 0"),
        ("-2", "1", "--request-rate must be above 0"),
        ("nan", "1", "--request-rate must be above 0"),
    ],
)
def test_bad_arrival_settings_are_refused_in_one_line(capsys, rate, burstiness, error):
    assert main(["bench", "--engine", "--request-rate", rate, "--burstiness", burstiness]) == 2
    assert error in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, error",
    [
        (["--backend", "openai"], "give --base-url or --launch"),
        (["--backend", "openai", "--launch", "--base-url", "http://h:1"], "give --base-url or --launch"),
        (["--backend", "openai", "--base-url", "http://h:1", "--engine"], "not --url or --engine"),
        (["--base-url", "http://h:1"], "--base-url and --compare-base-url need --backend openai"),
        (["--compare-base-url", "http://h:1", "--launch"], "need --backend openai"),
    ],
)
def test_flags_that_name_no_single_set_of_targets_are_refused_in_one_line(capsys, flags, error):
    assert main(["bench", *flags]) == 2
    assert error in capsys.readouterr().out
