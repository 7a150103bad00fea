"""shardline/core/batch/celery_wiring.py: a dead worker's chunk comes back soon after its visibility timeout."""

from __future__ import annotations

import pytest

from shardline.core.batch.celery_wiring import celery_app


@pytest.mark.parametrize(("timeout_s", "sweep_s"), [(10.0, 1), (60.0, 6), (3600.0, 10), (2.0, 1)])
def test_every_sweep_looks_for_expired_chunks_a_tenth_of_the_timeout_apart(timeout_s, sweep_s):
    # kombu's defaults scan on every tenth sweep of 10 s: a chunk whose worker died at a 10 s timeout
    # came back up to 100 s late (seen in tests/e2e/test_batch_faults.py: 108 s against 17 s).
    options = celery_app("redis://127.0.0.1:1/0", timeout_s).conf.broker_transport_options
    assert options["visibility_timeout"] == timeout_s
    assert options["unacked_restore_interval"] == sweep_s
    assert options["unacked_restore_throttle"] == 1
