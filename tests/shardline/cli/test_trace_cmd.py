"""`shardline trace export` and `shardline trace view`: flags, selection, files written, the viewer's server."""

import argparse
import asyncio
from pathlib import Path
from urllib.parse import unquote, urlsplit

import aiohttp
import pytest
from aiohttp import web
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

from shardline.cli import trace_cmd
from tests.tracing.collector.fake_request import SpanFactory
from tests.tracing.collector.served_request import engine_steps, served_request, to_otlp
from tests.tracing.run_async import run_async
from tracing.collector.span_store import SpanStore

NS = 1_000_000_000


def parse(*argv: str) -> argparse.Namespace:
    # Only the trace command: the full CLI parser imports the engine (torch) for `bench`.
    parser = argparse.ArgumentParser(prog="shardline")
    trace_cmd.add_parser(parser.add_subparsers())
    return parser.parse_args(["trace", *argv])


def main(argv: list[str]) -> int:
    args = parse(*argv[1:])
    return args.func(args)


def selection(*argv: str) -> trace_cmd.Selection:
    return trace_cmd.Selection.from_args(parse("export", *argv))


def test_selection_flags() -> None:
    assert selection() == trace_cmd.Selection([], last=1)
    assert selection("--request", "a", "--request", "b") == trace_cmd.Selection(["a", "b"])
    assert selection("--last", "5") == trace_cmd.Selection([], last=5)
    assert selection("--since", "100", "--until", "2025-11-24T16:00:00Z").window == (100 * NS, 1_764_000_000 * NS)
    for argv, message in (
        (("--request", "a", "--last", "2"), "one of"),
        (("--last", "1", "--since", "5"), "one of"),
        (("--last", "0"), "at least 1"),
        (("--since", "then"), "not a time"),
    ):
        with pytest.raises(ValueError, match=message):
            selection(*argv)


def test_default_file_names() -> None:
    assert selection("--request", "r-a").default_name(["r-a"]) == "r-a.pftrace"
    assert selection("--last", "3").default_name(["x", "y", "z"]) == "last-3.pftrace"
    assert selection("--since", "100", "--until", "200").default_name([]) == "window-100-200.pftrace"


def _store_two_requests(redis_url: str) -> None:
    async def store() -> None:
        f = SpanFactory()
        spans = served_request(f, "r-a", "a1" * 16) + served_request(f, "r-b", "b2" * 16, at_ms=200)
        spans += engine_steps(f, 0, 300)
        spans_store = SpanStore.from_url(redis_url, max_spans=10_000, max_age_s=1e12)
        try:
            await spans_store.add(to_otlp(spans))
        finally:
            await spans_store.close()

    asyncio.run(store())


def _request_tracks(path: Path) -> set[str]:
    trace = pb.Trace.FromString(path.read_bytes())
    return {p.track_descriptor.name for p in trace.packet if p.track_descriptor.name.startswith("request ")}


def test_export_writes_the_selected_requests(redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _store_two_requests(redis_url)
    one, last = tmp_path / "one.pftrace", tmp_path / "last.pftrace"
    assert main(["trace", "export", "--request", "r-a", "-o", str(one), "--redis-url", redis_url]) == 0
    assert f"wrote {one}: " in capsys.readouterr().out
    assert main(["trace", "export", "--last", "2", "-o", str(last), "--redis-url", redis_url]) == 0
    assert "requests: r-b, r-a" in capsys.readouterr().out
    assert _request_tracks(one) == {"request r-a"}
    assert _request_tracks(last) == {"request r-a", "request r-b"}
    assert main(["trace", "export", "--request", "absent", "-o", str(tmp_path / "x"), "--redis-url", redis_url]) == 1
    assert "no stored spans match" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    assert main(["trace", "export", "--last", "1", "--until", "5", "--redis-url", redis_url]) == 2
    assert main(["trace", "export", "--redis-url", "redis://127.0.0.1:1/0"]) == 1
    assert "span store is unreachable" in capsys.readouterr().err
    unwritable = tmp_path / "no-such-dir" / "x.pftrace"
    assert main(["trace", "export", "--request", "r-a", "-o", str(unwritable), "--redis-url", redis_url]) == 1
    assert f"cannot write {unwritable}: No such file or directory" in capsys.readouterr().err


@run_async
async def test_view_serves_the_ui_and_the_trace(tmp_path: Path) -> None:
    trace = tmp_path / "r-a.pftrace"
    trace.write_bytes(b"\x0a\x00pftrace bytes")
    runner = web.AppRunner(trace_cmd.build_view_app(trace))
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        url = trace_cmd.view_url("127.0.0.1", port, trace)
        ui, fragment = url.split("#", 1)
        trace_url = unquote(fragment.removeprefix("!/viewer?url="))
        async with aiohttp.ClientSession() as http:
            async with http.get(ui) as response:
                assert "<title>Perfetto UI</title>" in await response.text()
            async with http.get(trace_url) as response:
                assert response.status == 200 and await response.read() == trace.read_bytes()
    finally:
        await runner.cleanup()
    assert ui == f"http://127.0.0.1:{port}/perfetto/"
    assert urlsplit(trace_url).path == "/trace/r-a.pftrace"


def test_view_refuses_a_missing_file(tmp_path: Path) -> None:
    assert main(["trace", "view", str(tmp_path / "none.pftrace"), "--no-browser"]) == 2
