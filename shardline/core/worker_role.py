"""A worker's role in a pool that disaggregates prefill from decode (docs/kv_transfer.md#worker-roles)."""

from typing import Literal

# prefill: computes long prompts' KV for decode workers and runs no request itself; decode: runs
# requests, whose long prompts the scheduler may have a prefill worker compute; both: runs requests
# and prefills them itself, as every worker did before roles.
WorkerRole = Literal["prefill", "decode", "both"]
ROLES: tuple[WorkerRole, ...] = ("prefill", "decode", "both")


def role_of(registered: str) -> WorkerRole:
    """The role a worker registered with (WorkerInfo.role); empty is a worker from before roles: both.
    ValueError for any other name."""
    for role in ROLES:
        if registered == role:
            return role
    if not registered:
        return "both"
    raise ValueError(f"must be one of {', '.join(ROLES)}, got {registered!r}")
