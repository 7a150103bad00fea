"""Each policy's rule: from one interval's reading to a proposed worker count, with its reason."""

import math
from collections.abc import Callable
from dataclasses import dataclass

from scheduler_svc.autoscale.config import AutoscaleConfig


@dataclass(frozen=True, slots=True)
class Reading:
    """What one interval's rules compare, already measured and forecast."""

    actual: int  # workers that exist: ready or starting
    ready: int  # workers serving (not starting, not draining)
    slots: int  # requests one worker runs at once
    demand: int  # requests running or queued
    smoothed_demand: float  # the same, smoothed (utilisation_half_life_s)
    utilisation: float  # demand over the ready workers' slots (above 1 while requests queue)
    smoothed_utilisation: float  # the same, smoothed (utilisation_half_life_s)
    forecast_utilisation: float  # the forecast load over all `actual` workers' slots, at the horizon
    target: int  # the forecast's count, within bounds
    rate_target: int  # the count the last interval's measured arrival rate asks for, within bounds
    demand_target: int  # the count that runs `demand` at the target utilisation, within bounds


Rule = Callable[[AutoscaleConfig, Reading], tuple[int, float, str]]


def static(config: AutoscaleConfig, r: Reading) -> tuple[int, float, str]:
    return r.actual, r.utilisation, f"static: keeps {r.actual}"


def reactive(config: AutoscaleConfig, r: Reading) -> tuple[int, float, str]:
    """Kubernetes HPA on requests per worker (running + queued, averaged), target slots x target_utilisation.

    desired = ceil(actual x metric / target), skipped within the tolerance. As HPA does, workers not
    yet ready count as using nothing when the count would rise (so a scale-up is not asked again while
    it starts) and as exactly on target when it would fall.
    """
    per_worker_target = r.slots * config.target_utilisation
    if r.actual == 0:
        wanted = math.ceil(r.demand / per_worker_target)
        return wanted, r.utilisation, f"reactive: {r.demand} requests and no worker, wants {wanted}"
    starting = r.actual - r.ready
    demand = max(r.smoothed_demand, 0.0)
    ratio = demand / (r.actual * per_worker_target)
    if ratio < 1.0:
        ratio = (demand + starting * per_worker_target) / (r.actual * per_worker_target)
        if ratio >= 1.0:  # as HPA: a direction that reverses once starting workers are counted is no change
            return r.actual, ratio * config.target_utilisation, f"reactive: workers still starting, keeps {r.actual}"
    if abs(ratio - 1.0) <= config.tolerance:
        return r.actual, ratio * config.target_utilisation, f"reactive: within tolerance, keeps {r.actual}"
    wanted = math.ceil(ratio * r.actual - 1e-9)
    return (
        wanted,
        ratio * config.target_utilisation,
        (
            f"reactive: utilisation {ratio * config.target_utilisation:.2f} against {config.target_utilisation:.2f}, "
            f"wants {wanted}"
        ),
    )


def naive(config: AutoscaleConfig, r: Reading) -> tuple[int, float, str]:
    return r.target, r.utilisation, f"naive: the forecast asks for {r.target}"


def lt_u(config: AutoscaleConfig, r: Reading) -> tuple[int, float, str]:
    """SageServe's LT-U: past a threshold, step toward the forecast's count, never beyond it."""
    return _long_term(config, r, adaptive=False)


def lt_ua(config: AutoscaleConfig, r: Reading) -> tuple[int, float, str]:
    """SageServe's LT-UA: as LT-U, but a utilisation that stays past a threshold moves beyond the
    forecast's count, toward what the measured rate or the requests running and queued ask for; and
    one that stays below the lower threshold moves below it, toward what the measured rate asks for."""
    return _long_term(config, r, adaptive=True)


def _long_term(config: AutoscaleConfig, r: Reading, adaptive: bool) -> tuple[int, float, str]:
    name = "lt-ua" if adaptive else "lt-u"
    step = max(1, math.ceil(r.actual * config.step_fraction))
    # Up on the raw utilisation, or on the forecast's over the horizon (a cold start ahead): a burst is
    # seen at once, and the forecast's count caps the move, so noise cannot push past it. Beyond the
    # forecast only on the smoothed utilisation, which noise does not hold above the threshold.
    busy = max(r.utilisation, r.forecast_utilisation)
    if busy > config.upper_utilisation or r.actual == 0 < r.demand:
        goal, compared = max(r.target, 1 if r.demand else 0), busy
        if adaptive and r.smoothed_utilisation > config.upper_utilisation:
            compared = r.smoothed_utilisation
            goal = max(goal, r.rate_target, r.demand_target)
        if goal > r.actual:
            desired = min(goal, r.actual + step)
            return (
                desired,
                compared,
                (
                    f"{name}: utilisation {compared:.2f} > {config.upper_utilisation:.2f}, "
                    f"+{desired - r.actual} toward {goal}"
                ),
            )
        return r.actual, compared, f"{name}: utilisation {compared:.2f} high, at the forecast's {r.target}"
    if r.smoothed_utilisation < config.lower_utilisation:
        goal = min(r.target, r.rate_target) if adaptive else r.target
        if goal < r.actual:
            desired = max(goal, r.actual - step)
            return (
                desired,
                r.smoothed_utilisation,
                (
                    f"{name}: utilisation {r.smoothed_utilisation:.2f} < {config.lower_utilisation:.2f}, "
                    f"-{r.actual - desired} toward {goal}"
                ),
            )
        return r.actual, r.smoothed_utilisation, f"{name}: utilisation {r.smoothed_utilisation:.2f} low, at {r.actual}"
    return (
        r.actual,
        r.smoothed_utilisation,
        f"{name}: utilisation {r.smoothed_utilisation:.2f} in band, keeps {r.actual}",
    )


RULES: dict[str, Rule] = {"static": static, "reactive": reactive, "naive": naive, "lt-u": lt_u, "lt-ua": lt_ua}
