"""What carries out the autoscaler's decision: the interface every driver implements.

The scheduler decides how many workers each model should have and drains the ones it
removes; a driver only makes the platform's count follow. Scale-down always goes through a
drain first, so a driver is told which workers have already been drained and deregistered:
they, and no others, are the ones to take away.
"""

from collections.abc import Sequence
from typing import Protocol


class ScaleDriver(Protocol):
    """Makes the number of running workers of a model follow the scheduler's decision."""

    def scale(self, model: str, desired: int, retired: Sequence[str]) -> None:
        """Makes `desired` workers of `model` run.

        `retired` names the workers (their worker_id) that the scheduler has drained and
        deregistered on the way down: when the count falls, these are the ones removed.
        Raises on a failure the scheduler should log and retry at its next interval.
        """
        ...
