"""A model's LoRA slots: every LoRA-capable linear layer of every decoder layer gets a LoraSlots, and
an adapter is put in (or taken out of) one slot of all of them at once."""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker_svc.model.config import ModelConfig
from gpu_worker_svc.model.layers.lora import LoraSlots, LoraStep
from gpu_worker_svc.model.lora_adapter import LoraAdapter, lora_layers, lora_targets


class LoraModelSlots:
    """`num_slots` adapters of rank up to `rank`, resident in the model (slots 1..num_slots).

    The base layers stay as they are (GGUF blocks, oneDNN-packed or plain weights): the delta is added
    to their output. Only at TP 1: a sharded layer would need its A or B sharded like its weight.
    """

    def __init__(
        self, model: nn.Module, cfg: ModelConfig, num_slots: int, rank: int, dtype: torch.dtype, device: str
    ) -> None:
        if model.tp.world_size != 1:
            raise ValueError(f"tp_size: LoRA adapters are served at tp_size 1, got {model.tp.world_size}")
        self.model = model
        self.num_slots = num_slots
        self.rank = rank
        self.targets = lora_targets(cfg)
        self.step = LoraStep()
        self.layers: list[dict[str, LoraSlots]] = []
        for layer in model.model.layers:
            slots = {}
            for path, (in_features, sub_rows) in lora_layers(cfg).items():
                slots[path] = LoraSlots(self.step, in_features, sub_rows, num_slots, rank, dtype, device)
                layer.get_submodule(path).lora = slots[path]
            self.layers.append(slots)
        model.model.lora_step = self.step

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Puts `adapter` in slot `slot` (1..num_slots) of every layer, replacing what was there."""
        if not 1 <= slot <= self.num_slots or adapter.rank > self.rank:
            raise ValueError(f"slot {slot} of {self.num_slots} at rank {self.rank} cannot hold rank {adapter.rank}")
        for index, slots in enumerate(self.layers):
            parts = adapter.parts(index, self.targets)
            for path, layer_slots in slots.items():
                layer_slots.write(slot, parts.get(path, []))

    def detach(self) -> None:
        """Takes the slots out of the model (before slots of a higher rank replace them)."""
        for layer, slots in zip(self.model.model.layers, self.layers):
            for path in slots:
                layer.get_submodule(path).lora = None
        self.model.model.lora_step = None
