"""The .proto contracts: stubs generate and import, and every element is documented."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from shardline import protogen

# Numbers of the descriptor.proto fields holding each kind of element, as they
# appear in SourceCodeInfo.Location.path.
FILE_MESSAGE, FILE_ENUM, FILE_SERVICE = 4, 5, 6
MESSAGE_FIELD, MESSAGE_NESTED, MESSAGE_ENUM, MESSAGE_ONEOF = 2, 3, 4, 8
ENUM_VALUE = 2
SERVICE_METHOD = 2


def test_generate_writes_every_stub_and_they_import() -> None:
    written = protogen.generate()
    assert sorted(written) == sorted(protogen.expected_stubs())
    assert not protogen.stubs_are_stale()
    # A fresh interpreter proves the generated `from shardline.v1 import ...` lines resolve.
    code = (
        "from shardline.proto import generation_pb2, generation_pb2_grpc, scheduler_pb2_grpc,"
        " tokenizer_pb2_grpc, worker_pb2_grpc, worker_pb2\n"
        "r = generation_pb2.GenerateRequest(prompt='hi', request_id='r1')\n"
        "assert r.WhichOneof('input') == 'prompt' and r.HasField('request_id')\n"
        "assert not generation_pb2.GenerateRequest().params.HasField('temperature')\n"
        "cmd = worker_pb2.WorkerCommand(abort=['a'])\n"
        "assert worker_pb2.WorkerCommand.FromString(cmd.SerializeToString()).abort == ['a']\n"
        "assert hasattr(generation_pb2_grpc, 'GenerationServicer')\n"
        "assert hasattr(scheduler_pb2_grpc, 'SchedulerStub')\n"
        "assert hasattr(tokenizer_pb2_grpc, 'TokenizerStub')\n"
        "assert hasattr(worker_pb2_grpc, 'add_WorkerServicer_to_server')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=protogen.PACKAGE_DIR.parent)


def test_ensure_stubs_regenerates_stale_stubs() -> None:
    protogen.ensure_stubs()
    stub = protogen.STUB_DIR / "sampling_pb2.py"
    newest_proto = max(p.stat().st_mtime for p in protogen.proto_files())
    # Age a stub rather than touch a .proto, which is tracked source.
    os.utime(stub, (newest_proto - 60, newest_proto - 60))
    assert protogen.stubs_are_stale()
    protogen.ensure_stubs()
    assert stub.stat().st_mtime >= newest_proto
    assert not protogen.stubs_are_stale()


def test_protoc_error_is_reported_and_keeps_old_stubs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proto_dir = tmp_path / "protos" / "shardline" / "v1"
    proto_dir.mkdir(parents=True)
    (proto_dir / "bad.proto").write_text('syntax = "proto3";\nmessage Broken { strin x = 1; }\n')
    stub_dir = tmp_path / "stubs"
    stub_dir.mkdir()
    (stub_dir / "bad_pb2.py").write_text("OLD = True\n")
    monkeypatch.setattr(protogen, "PROTO_ROOT", tmp_path / "protos")
    monkeypatch.setattr(protogen, "PROTO_DIR", proto_dir)
    monkeypatch.setattr(protogen, "STUB_DIR", stub_dir)
    with pytest.raises(protogen.ProtogenError, match="strin"):
        protogen.generate()
    assert (stub_dir / "bad_pb2.py").read_text() == "OLD = True\n"


def _descriptor_set(tmp_path: Path) -> descriptor_pb2.FileDescriptorSet:
    out = tmp_path / "descriptors.pb"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{protogen.PROTO_ROOT}",
            f"-I{protogen.WELL_KNOWN_INCLUDE}",
            "--include_source_info",
            f"--descriptor_set_out={out}",
            *map(str, protogen.proto_files()),
        ],
        check=True,
    )
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def _documentable(file: descriptor_pb2.FileDescriptorProto) -> list[tuple[str, tuple[int, ...]]]:
    """(name, source path) of every service, rpc, message, field, oneof, enum and enum value."""
    found: list[tuple[str, tuple[int, ...]]] = []

    def enum(e: descriptor_pb2.EnumDescriptorProto, path: tuple[int, ...]) -> None:
        found.append((e.name, path))
        found.extend((v.name, (*path, ENUM_VALUE, i)) for i, v in enumerate(e.value))

    def message(m: descriptor_pb2.DescriptorProto, path: tuple[int, ...]) -> None:
        if m.options.map_entry:
            return  # synthesized by protoc for map<> fields; it has no source text
        found.append((m.name, path))
        found.extend((f"{m.name}.{f.name}", (*path, MESSAGE_FIELD, i)) for i, f in enumerate(m.field))
        synthetic = {f.oneof_index for f in m.field if f.proto3_optional}
        found.extend(
            (f"{m.name}.{o.name}", (*path, MESSAGE_ONEOF, i))
            for i, o in enumerate(m.oneof_decl)
            if i not in synthetic  # proto3 `optional` makes a hidden one-field oneof
        )
        for i, nested in enumerate(m.nested_type):
            message(nested, (*path, MESSAGE_NESTED, i))
        for i, nested_enum in enumerate(m.enum_type):
            enum(nested_enum, (*path, MESSAGE_ENUM, i))

    for i, m in enumerate(file.message_type):
        message(m, (FILE_MESSAGE, i))
    for i, e in enumerate(file.enum_type):
        enum(e, (FILE_ENUM, i))
    for i, s in enumerate(file.service):
        found.append((s.name, (FILE_SERVICE, i)))
        found.extend((f"{s.name}.{r.name}", (FILE_SERVICE, i, SERVICE_METHOD, j)) for j, r in enumerate(s.method))
    return found


def test_every_element_has_a_triple_slash_doc_comment(tmp_path: Path) -> None:
    files = [f for f in _descriptor_set(tmp_path).file if f.name.startswith("shardline/")]
    assert {f.name for f in files} == {f"shardline/v1/{p.name}" for p in protogen.proto_files()}
    undocumented = []
    checked = set()
    for file in files:
        assert file.package == "shardline.v1"
        comments = {tuple(loc.path): loc.leading_comments for loc in file.source_code_info.location}
        for name, path in _documentable(file):
            checked.add(name)
            # protoc strips the `//`, so a `///` doc comment starts with the third slash.
            if not comments.get(path, "").startswith("/"):
                undocumented.append(f"{file.name}: {name}")
    # The walk reaches every kind of element, so an empty result means something.
    assert {
        "Generation.Resume",
        "GenerateRequest.input",
        "GenerateRequest.prompt",
        "FinishReason",
        "FINISH_REASON_STOP",
        "SchedulerStats.queue_depth",
        "SamplingParameters.seed",
    } <= checked
    assert undocumented == []


def test_services_expose_the_contracted_rpcs(tmp_path: Path) -> None:
    services = {
        s.name: {m.name: (m.client_streaming, m.server_streaming) for m in s.method}
        for f in _descriptor_set(tmp_path).file
        for s in f.service
    }
    unary, server_stream, bidi = (False, False), (False, True), (True, True)
    assert services["Generation"] == {
        "Generate": unary,
        "GenerateStream": server_stream,
        "Cancel": unary,
        "Resume": server_stream,
        "GetRequest": unary,
        "ListModels": unary,
        "LoadLoraAdapter": unary,
        "UnloadLoraAdapter": unary,
    }
    assert services["Tokenizer"] == {
        "Tokenize": unary,
        "ApplyChatTemplate": unary,
        "Detokenize": unary,
        "GetInfo": unary,
        "GetDefinition": unary,
        "CheckStructuredOutput": unary,
    }
    assert services["Scheduler"] == {
        "Submit": unary,
        "Cancel": unary,
        "Subscribe": server_stream,
        "RegisterWorker": unary,
        "Heartbeat": unary,
        "GetRequest": unary,
        "ListWorkers": unary,
        "GetStats": unary,
        "Attach": unary,
        "DrainWorker": unary,
        "LoadLoraAdapter": unary,
        "UnloadLoraAdapter": unary,
    }
    assert services["Worker"] == {
        "Session": bidi,
        "GetInfo": unary,
        "LoadLoraAdapter": unary,
        "UnloadLoraAdapter": unary,
    }
    client_stream = (True, False)
    assert services["Batches"] == {
        "UploadFile": client_stream,
        "GetFile": unary,
        "ListFiles": unary,
        "DeleteFile": unary,
        "DownloadFile": server_stream,
        "CreateBatch": unary,
        "GetBatch": unary,
        "ListBatches": unary,
        "CancelBatch": unary,
    }
