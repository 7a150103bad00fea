"""A request's SLO: its TTFT target, and whether to refuse it once late rather than serve it late.

Over HTTP, two extension fields of the completions and chat bodies (as vLLM's `priority` is one):
`ttft_target_ms` and `refuse_late`; over gRPC, GenerateRequest's `ttft_target` and `refuse_late`.
A request without them takes its tenant's defaults (the tenants file's `slo`). The scheduler serves
a tenant's waiting requests earliest deadline first, and refuses those that asked once their
deadline passes while they wait (HTTP 503, UNAVAILABLE).
"""

import math
from dataclasses import dataclass

from shardline.core.errors import InvalidArgument

# Longer targets are no targets: they would order nothing against the gateway's own timeouts.
MAX_TTFT_TARGET_S = 24 * 3600.0


@dataclass(frozen=True, slots=True)
class Slo:
    """What a request or its tenant asks for; None: not said (the tenant's, else none)."""

    ttft_target_s: float | None = None  # first token within this long of arrival
    refuse_late: bool | None = None  # fail it once that can no longer be met while it waits

    def over(self, default: "Slo") -> "Slo":
        """This, with what it leaves unsaid taken from `default` (the tenant's)."""
        return Slo(
            self.ttft_target_s if self.ttft_target_s is not None else default.ttft_target_s,
            self.refuse_late if self.refuse_late is not None else default.refuse_late,
        )


def checked_target(seconds: float, field: str) -> float:
    """A TTFT target in seconds, checked; InvalidArgument names `field`."""
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_TTFT_TARGET_S):
        raise InvalidArgument(field, f"must be a time in (0, {MAX_TTFT_TARGET_S * 1000:.0f}] ms")
    return seconds
