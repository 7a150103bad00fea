"""Trace files round-trip, bad rows name their line, and the shapes have the rates they promise."""

from pathlib import Path

import numpy as np
import pytest

from scheduler_svc.autoscale.trace import Trace, read_trace, write_trace
from scheduler_svc.autoscale.trace_shapes import generate_trace


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_a_written_trace_reads_back_the_same(tmp_path: Path, suffix: str):
    trace = generate_trace("diurnal", 600.0, 2.0, seed=1)
    write_trace(trace, tmp_path / f"t{suffix}")
    back = read_trace(tmp_path / f"t{suffix}")
    assert np.allclose(back.timestamps, trace.timestamps, atol=1e-3)
    assert (back.input_tokens == trace.input_tokens).all() and (back.output_tokens == trace.output_tokens).all()


def test_rows_out_of_order_are_sorted_and_times_start_at_zero():
    trace = Trace.of([105.0, 100.0, 101.0], [1, 2, 3], [4, 5, 6])
    assert trace.timestamps.tolist() == [0.0, 1.0, 5.0] and trace.input_tokens.tolist() == [2, 3, 1]


def test_a_bad_row_names_its_file_and_line(tmp_path: Path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_tokens": 5, "output_tokens": 5}\n{"timestamp": 1, "input_tokens": 5}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: no 'output_tokens'"):
        read_trace(bad)
    csv = tmp_path / "bad.csv"
    csv.write_text("timestamp,input_tokens\n0,1\n")
    with pytest.raises(ValueError, match="header lacks output_tokens"):
        read_trace(csv)


def test_the_burst_is_five_times_the_base_and_the_ramp_rises_eightfold():
    burst = generate_trace("burst", 6 * 3600.0, 2.0, seed=2, noise=0.0)
    hours = np.histogram(burst.timestamps, bins=6, range=(0, 6 * 3600))[0] / 3600
    assert hours[0] == pytest.approx(2.0, rel=0.05) and hours[5] == pytest.approx(2.0, rel=0.05)
    assert (hours[2] + hours[3]) / 2 == pytest.approx(6.0, rel=0.05)  # half of each hour is in the 5x hour
    ramp = generate_trace("ramp", 6 * 3600.0, 1.0, seed=2, noise=0.0)
    tenths = np.histogram(ramp.timestamps, bins=12, range=(0, 6 * 3600))[0] / 1800
    assert tenths[0] < 1.5 and tenths[-1] == pytest.approx(8.0, rel=0.05)
