"""The LoRA adapters an engine serves: every one known keeps a copy on the host, and up to
max_loras_per_batch are resident in the model's slots, the least recently used giving its slot up.

The batch scheduler admits sequences of at most max_loras_per_batch adapters at once, so a step's
adapters always find slots; a sequence whose adapter finds none waits in the queue.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from gpu_worker_svc.model.config import ModelConfig
from gpu_worker_svc.model.lora_adapter import LoraAdapter, LoraAdapterError, read_lora_adapter
from shardline.core.prefix_hash import chain_root

log = logging.getLogger(__name__)


class UnknownAdapterError(LookupError):
    """A request names an adapter that this engine does not serve."""

    def __init__(self, name: str, known: Sequence[str]) -> None:
        listed = ", ".join(sorted(known)) or "none"
        super().__init__(f"model: LoRA adapter {name!r} is not loaded here (loaded: {listed})")
        self.name = name


class SlotWriter(Protocol):
    def write_lora_slot(self, slot: int, adapter: LoraAdapter, num_slots: int) -> None: ...


class LoraAdapters:
    """Known adapters by name, and the slots (1..num_slots) of the resident ones."""

    def __init__(
        self, runner: SlotWriter, model_config: ModelConfig, num_slots: int, max_rank: int, tp_size: int
    ) -> None:
        self.runner = runner
        self.model_config = model_config
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.tp_size = tp_size
        self._known: dict[str, LoraAdapter] = {}
        self._roots: dict[str, int] = {}  # name -> the prefix hash chain's root for its sequences
        self._resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recently used first

    def read(self, name: str, path: str | Path) -> LoraAdapter:
        """Reads and checks the adapter at `path` for this engine (LoraAdapterError); touches nothing,
        so any thread may call it."""
        if not name or name != name.strip():
            raise LoraAdapterError(name, "lora_name", "must be a non-empty name without surrounding spaces")
        if self.tp_size != 1:
            raise LoraAdapterError(
                name, "tp_size", f"adapters are served at tp_size 1, this worker runs {self.tp_size}"
            )
        return read_lora_adapter(name, path, self.model_config, self.max_rank)

    def put(self, adapter: LoraAdapter) -> None:
        """Serves a read adapter by its name; one already served by that name is replaced, its slot given up."""
        self._resident.pop(adapter.name, None)
        self._known[adapter.name] = adapter
        self._roots[adapter.name] = chain_root(adapter.identity)
        log.info("LoRA adapter %s served from %s (rank %d)", adapter.name, adapter.path, adapter.rank)

    def remove(self, name: str) -> bool:
        """Stops serving `name` (the caller checked that no sequence runs with it); False if unknown."""
        if self._known.pop(name, None) is None:
            return False
        self._roots.pop(name)
        self._resident.pop(name, None)
        return True

    def get(self, name: str) -> LoraAdapter | None:
        return self._known.get(name)

    @property
    def names(self) -> list[str]:
        return sorted(self._known)

    @property
    def resident(self) -> list[str]:
        """The adapters in the model's slots, least recently used first."""
        return list(self._resident)

    def root_of(self, name: str) -> int:
        """The prefix hash chain's root of `name`'s sequences (UnknownAdapterError)."""
        root = self._roots.get(name)
        if root is None:
            raise UnknownAdapterError(name, list(self._known))
        return root

    def slots_for(self, adapters: Sequence[str | None]) -> list[int]:
        """The slot of each entry's adapter (0: the base model), making the missing ones resident in the
        slots of the least recently used ones that this step does not use."""
        wanted = list(dict.fromkeys(a for a in adapters if a is not None))
        if len(wanted) > self.num_slots:  # the batch scheduler admits no more adapters than slots
            raise ValueError(f"{len(wanted)} adapters in one step, max_loras_per_batch is {self.num_slots}")
        for name in wanted:
            if name in self._resident:
                self._resident.move_to_end(name)
        for name in wanted:
            if name not in self._resident:
                self._resident[name] = self._free_slot(set(wanted))
                self.runner.write_lora_slot(self._resident[name], self._known[name], self.num_slots)
        return [0 if a is None else self._resident[a] for a in adapters]

    def _free_slot(self, in_use: set[str]) -> int:
        taken = set(self._resident.values())
        free = next((s for s in range(1, self.num_slots + 1) if s not in taken), None)
        if free is not None:
            return free
        victim = next(name for name in self._resident if name not in in_use)
        return self._resident.pop(victim)
