"""`shardline up --verbose --no-tracing`: every service's log lines on the console as before, no
tracing service; once it stops, `shardline status` says that nothing runs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.up_process import INFO_RECORD, UpProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def up(tmp_path_factory) -> Iterator[UpProcess]:
    stack = UpProcess(tmp_path_factory.mktemp("up-verbose"), "--verbose", "--no-tracing")
    try:
        stack.wait_for(r"^Ctrl-C stops everything", timeout_s=240)
        yield stack
    finally:
        stack.stop()


def test_verbose_puts_the_services_info_lines_on_the_console_and_no_log_files(up):
    records = INFO_RECORD.findall(up.output)
    assert len(records) >= 5, up.output
    assert "gpu_worker_svc INFO engine ready" in up.output
    assert "INFO gateway" in up.output
    assert not (up.data_dir / "logs").exists()


def test_no_tracing_starts_no_tracing_service_and_prints_no_dashboard(up):
    assert "tracing    ready" not in up.output
    assert "traces        " not in up.output and "dashboard" not in up.output
    done = up.status()
    assert done.returncode == 0, done
    assert "\n  tracing " not in done.stdout and "dashboard" not in done.stdout
    assert "\n  gateway     up    " in done.stdout


def test_once_up_stops_status_says_no_stack_runs(up):
    assert up.stop() == 0, up.output
    assert "shardline: shutting down ..." in up.output
    done = up.status()
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip() == (
        f"shardline status: no stack is running on {up.data_dir} "
        "(`shardline up` starts one; --data-dir names another stack's folder)"
    )
