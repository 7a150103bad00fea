"""Shardline's shared core: config, stubs, the Redis state store, the text library, the CLI and the SDK."""

import os

# gRPC's fork handlers can crash a child forked while other threads are inside gRPC (36 of 200
# forks, under load). No Shardline process forks to use gRPC in the child (the stack's services
# are exec'd, the worker's ranks spawned), so the handlers are off unless the user turns them on.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
