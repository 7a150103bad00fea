"""Virtual token counters (VTC; Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024).

Each tenant's counter is the service it got, in weighted tokens divided by its weight: a
prompt token costs INPUT_COST when its request is dispatched, a generated token OUTPUT_COST
as the worker's steps report it. Within a priority class the queue serves the backlogged
tenant with the least counter, which bounds the service gap between two backlogged tenants
(the paper's Theorem: twice the cost of the largest request a batch can hold). A tenant that
had nothing queued is lifted, when it queues again, to the least counter of those that do,
so that time away banks no credit.

The counters live in the scheduler's memory only: a restarted scheduler starts them again at
zero, which loses nothing the bound needs, since only the tenants backlogged from then on count.
"""

from collections.abc import Iterable

INPUT_COST = 1.0  # per prompt token (the paper's w_in)
OUTPUT_COST = 2.0  # per generated token (w_out): decode costs more per token than prefill


class VirtualCounters:
    """Per tenant, the weighted tokens it has been served so far."""

    def __init__(self) -> None:
        self._counters: dict[str, float] = {}
        self._last_served = ""  # the tenant dispatched last: the floor when no one else waits

    def __getitem__(self, tenant: str) -> float:
        return self._counters.get(tenant, 0.0)

    def activate(self, tenant: str, backlogged: Iterable[str]) -> None:
        """Lifts a tenant that had nothing queued to the least counter of the tenants that have
        (with none, to the counter of the tenant served last), so idle time banks no credit."""
        counters = [self[other] for other in backlogged if other != tenant]
        floor = min(counters) if counters else self[self._last_served]
        self._counters[tenant] = max(self[tenant], floor)

    def served(self, tenant: str, weight: float, prompt_tokens: int) -> None:
        """Charges a tenant for a request dispatched with `prompt_tokens` to prefill."""
        self._last_served = tenant
        self._charge(tenant, weight, INPUT_COST * prompt_tokens)

    def generated(self, tenant: str, weight: float, tokens: int) -> None:
        """Charges a tenant for `tokens` its running requests generated."""
        self._charge(tenant, weight, OUTPUT_COST * tokens)

    def _charge(self, tenant: str, weight: float, cost: float) -> None:
        self._counters[tenant] = self[tenant] + cost / weight
