"""VTC in the queue, against the paper's properties: a bounded gap between backlogged tenants,
service by weight, no credit banked while idle, strict priority across classes."""

import itertools
from collections import defaultdict
from dataclasses import dataclass, field

from scheduler_svc.fair_share import INPUT_COST, OUTPUT_COST, VirtualCounters
from scheduler_svc.live_request import LiveRequest
from scheduler_svc.request_queue import RequestQueue
from shardline.proto import sampling_pb2

_ids = itertools.count()


def _request(tenant: str, prompt: int = 4, weight: float = 1.0, priority: int = 0) -> LiveRequest:
    n = next(_ids)
    return LiveRequest(
        request_id=f"{tenant}-{n}",
        gateway_id="gw",
        model="m",
        priority=priority,
        prompt_token_ids=[1] * prompt,
        params=sampling_pb2.SamplingParameters(),
        eos_token_ids=[],
        arrival_ts=float(n),
        tenant=tenant,
        tenant_weight=weight,
    )


def _admit(queue: RequestQueue, request: LiveRequest) -> None:
    queue.reserve()
    queue.push(request)


@dataclass
class Workload:
    """A tenant's requests: prompt and output lengths, weight, and how many it keeps queued (more
    than a step can dispatch, so that it stays backlogged, as the paper's bound assumes)."""

    prompt: int
    output: int
    weight: float = 1.0
    backlog: int = 8


@dataclass
class Engine:
    """A continuous-batching server of `slots` requests, one token per running request per step,
    charging the queue's counters as the scheduler does (prompt at dispatch, output per step)."""

    queue: RequestQueue
    slots: int
    running: list[list] = field(default_factory=list)  # [request, tokens left]
    service: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # unweighted, as the paper's W

    def step(self) -> None:
        while len(self.running) < self.slots and (request := self.queue.pop(lambda r: True)) is not None:
            self.service[request.tenant] += INPUT_COST * len(request.prompt_token_ids)
            self.running.append([request, request.params.max_tokens])
        for entry in self.running:
            request = entry[0]
            self.queue.counters.generated(request.tenant, request.tenant_weight, 1)
            self.service[request.tenant] += OUTPUT_COST
            entry[1] -= 1
        self.running = [entry for entry in self.running if entry[1] > 0]


def _keep_backlogged(queue: RequestQueue, workloads: dict[str, Workload]) -> None:
    depth: dict[str, int] = defaultdict(int)
    for tenants in queue._classes.values():
        for tenant, fifo in tenants.items():
            depth[tenant] += len(fifo)
    for tenant, load in workloads.items():
        for _ in range(load.backlog - depth[tenant]):
            request = _request(tenant, load.prompt, load.weight)
            request.params.max_tokens = load.output
            _admit(queue, request)


def _run(workloads: dict[str, Workload], steps: int, slots: int = 4) -> tuple[Engine, float]:
    """Serves backlogged tenants for `steps`; returns the engine and the largest service gap seen
    between any two of them, each service divided by its weight."""
    queue = RequestQueue(capacity=10_000)
    engine = Engine(queue, slots)
    worst = 0.0
    for _ in range(steps):
        _keep_backlogged(queue, workloads)
        engine.step()
        weighted = [engine.service[t] / w.weight for t, w in workloads.items()]
        worst = max(worst, max(weighted) - min(weighted))
    return engine, worst


def _bound(workloads: dict[str, Workload], slots: int) -> float:
    """The paper's 2U: U = w_in * longest prompt + w_out * the tokens a batch holds."""
    longest_prompt = max(w.prompt for w in workloads.values())
    batch_tokens = slots * max(w.prompt + w.output for w in workloads.values())
    return 2 * (INPUT_COST * longest_prompt + OUTPUT_COST * batch_tokens)


def test_two_backlogged_tenants_of_equal_weight_stay_within_the_bound() -> None:
    # A floods with long requests, B keeps a few short ones queued: still equal service.
    workloads = {"a": Workload(prompt=60, output=30, backlog=40), "b": Workload(prompt=8, output=6, backlog=5)}
    engine, worst = _run(workloads, steps=2000)
    assert worst <= _bound(workloads, slots=4)
    assert engine.service["a"] > 10_000 and engine.service["b"] > 10_000


def test_one_tenant_alone_is_served_in_arrival_order() -> None:
    # Without a tenants file every request is the default tenant's: the queue is FIFO, as before VTC.
    queue = RequestQueue(capacity=100)
    requests = [_request("default", prompt=50 if i < 5 else 1) for i in range(6)]
    for request in requests:
        _admit(queue, request)
    assert [queue.pop(lambda r: True) for _ in range(6)] == requests


def test_weights_two_to_one_give_two_to_one_service() -> None:
    workloads = {"gold": Workload(prompt=20, output=10, weight=2.0), "free": Workload(prompt=20, output=10)}
    engine, worst = _run(workloads, steps=3000)
    ratio = engine.service["gold"] / engine.service["free"]
    assert 1.9 <= ratio <= 2.1, ratio
    assert worst <= _bound(workloads, slots=4)


def test_an_idle_tenant_returning_gets_no_banked_credit() -> None:
    workloads = {"a": Workload(prompt=10, output=10)}
    queue = RequestQueue(capacity=10_000)
    engine = Engine(queue, slots=4)
    for _ in range(500):  # B is away: A alone is served, and its counter grows
        _keep_backlogged(queue, workloads)
        engine.step()
    a_counter = queue.counters["a"]
    assert a_counter > 5000
    workloads["b"] = Workload(prompt=10, output=10)
    _keep_backlogged(queue, workloads)
    assert queue.counters["b"] == a_counter  # lifted to the least counter of the backlogged tenants
    before = dict(engine.service)
    for _ in range(500):
        _keep_backlogged(queue, workloads)
        engine.step()
    gained_a, gained_b = (engine.service[t] - before.get(t, 0.0) for t in ("a", "b"))
    # From its return on, B gets its fair half, not 500 steps' worth of catching up.
    assert abs(gained_a - gained_b) <= _bound(workloads, slots=4)


def test_a_tenant_arriving_at_an_empty_queue_starts_from_the_last_served() -> None:
    queue = RequestQueue(capacity=10)
    _admit(queue, _request("a", prompt=100))
    assert queue.pop(lambda r: True).tenant == "a"
    _admit(queue, _request("b"))  # nothing else waits: its floor is A's counter
    assert queue.counters["b"] == queue.counters["a"] == 100 * INPUT_COST


def test_strict_priority_across_classes_whatever_the_counters() -> None:
    queue = RequestQueue(capacity=10)
    queue.counters.generated("heavy", 1.0, 1_000_000)
    _admit(queue, _request("light", priority=1))
    _admit(queue, _request("heavy", priority=0))
    assert [queue.pop(lambda r: True).tenant for _ in range(2)] == ["heavy", "light"]


def test_fifo_within_a_tenant_and_least_counter_first_across_tenants() -> None:
    queue = RequestQueue(capacity=10)
    a1, a2, b1 = _request("a", prompt=10), _request("a", prompt=10), _request("b", prompt=10)
    for request in (a1, a2, b1):
        _admit(queue, request)
    # Counters tie at 0: the earliest head goes first; then B (0) before A (10); then A's next.
    assert [queue.pop(lambda r: True) for _ in range(3)] == [a1, b1, a2]


def test_a_redispatch_is_not_charged_again_and_returns_ahead_of_its_tenant() -> None:
    queue = RequestQueue(capacity=10)
    first, second = _request("a", prompt=10), _request("a", prompt=10)
    _admit(queue, first)
    _admit(queue, second)
    assert queue.pop(lambda r: True) is first
    first.attempt = 1
    queue.push_front(first)  # its worker died
    assert queue.pop(lambda r: True) is first
    assert queue.counters["a"] == 10 * INPUT_COST


def test_weight_divides_the_charge() -> None:
    counters = VirtualCounters()
    counters.served("t", 4.0, prompt_tokens=8)
    counters.generated("t", 4.0, tokens=6)
    assert counters["t"] == (8 * INPUT_COST + 6 * OUTPUT_COST) / 4
