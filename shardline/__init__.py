"""Shardline: LLM serving in Python. This package holds what every part of it shares.

- `shardline.client`: the SDK, sync and asyncio clients of the gateway's gRPC API;
- `shardline.proto`: the generated stubs of the shardline.v1 contract;
- `shardline.core`: the services' shared library (Redis state, gRPC serving, text, GGUF, errors);
- `shardline.stack`: running the whole stack on one machine (`shardline up`, the tests);
- `shardline.cli` and `shardline.bench`: the `shardline` command and its load generators.

`pip install shardline` is the SDK and the client commands; `shardline[serve]` adds the services.
"""

import os

# The one place the version is written: pyproject.toml reads it from here.
__version__ = "0.1.0"

# gRPC's fork handlers can crash a child forked while other threads are inside gRPC (36 of 200
# forks, under load). No Shardline process forks to use gRPC in the child (the stack's services
# are exec'd, the worker's ranks spawned), so the handlers are off unless the user turns them on.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
