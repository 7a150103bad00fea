"""The worker services `shardline up --prefill-workers N --decode-workers M` starts, and their roles."""

import pytest

from shardline.cli.main import build_parser
from shardline.stack.local_stack import LocalStack, StackConfig


def _workers(config: StackConfig) -> list[tuple[str, str, str]]:
    """(name, worker id, role) of each worker service, in start order."""
    return [
        (spec.name, str(spec.settings["WORKER_ID"]), str(spec.settings["ROLE"]))
        for spec in LocalStack(config).services()
        if spec.service == "worker"
    ]


def test_prefill_workers_start_first_and_make_the_other_workers_decode_workers() -> None:
    assert _workers(StackConfig(workers=2, prefill_workers=1)) == [
        ("prefill-0", "prefill-0", "prefill"),
        ("worker-0", "worker-0", "decode"),
        ("worker-1", "worker-1", "decode"),
    ]


def test_without_prefill_workers_every_worker_prefills_its_own_requests() -> None:
    assert _workers(StackConfig(workers=2)) == [("worker-0", "worker-0", "both"), ("worker-1", "worker-1", "both")]


def test_up_takes_decode_workers_instead_of_workers() -> None:
    parser = build_parser()
    args = parser.parse_args(["up", "--prefill-workers", "2", "--decode-workers", "3"])
    assert (args.prefill_workers, args.decode_workers) == (2, 3)
    assert parser.parse_args(["up"]).prefill_workers == 0
    with pytest.raises(SystemExit):  # one count of the workers that run requests, not two
        parser.parse_args(["up", "--workers", "2", "--decode-workers", "3"])
