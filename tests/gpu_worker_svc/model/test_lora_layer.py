"""The batched LoRA delta: every token gets its own adapter's delta (or none), as the merged weight
of that adapter would give, in one pass over the batch."""

from __future__ import annotations

import torch

from gpu_worker_svc.model.layers.lora import LoraSlots, LoraStep


def _select(slots: list[int], n: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(slots), n + 1)[:, 1:].float()


def _slots(step: LoraStep, in_features: int, sub_rows: list[int], num_slots: int, rank: int) -> LoraSlots:
    return LoraSlots(step, in_features, sub_rows, num_slots, rank, torch.float32, "cpu")


def test_each_token_gets_its_own_adapters_delta():
    g = torch.Generator().manual_seed(0)
    step = LoraStep()
    # A fused layer of two sub-modules (rows 0..5 and 6..9), slots padded to rank 4.
    layer = _slots(step, 8, [6, 4], num_slots=3, rank=4)
    dense = {}
    for slot, modules in ((1, [(0, 6, 2), (6, 4, 4)]), (2, [(0, 6, 4)]), (3, [(0, 10, 3)])):  # 3: one fused module
        parts, delta = [], torch.zeros(10, 8)
        for row, rows, r in modules:
            a, b = torch.randn(r, 8, generator=g), torch.randn(rows, r, generator=g)
            parts.append((row, a, b))
            delta[row : row + rows] += b @ a
        layer.write(slot, parts)
        dense[slot] = delta
    x = torch.randn(6, 8, generator=g)
    base = torch.randn(6, 10, generator=g)
    token_slots = [0, 2, 1, 3, 2, 0]
    step.select = _select(token_slots, 3)
    got = layer.add_to(base.clone(), x)
    expected = torch.stack([base[t] + (x[t] @ dense[s].T if s else 0) for t, s in enumerate(token_slots)])
    torch.testing.assert_close(got, expected)


def test_only_the_slots_in_use_are_multiplied_and_no_adapter_means_no_change():
    step = LoraStep()
    layer = _slots(step, 4, [4], num_slots=4, rank=2)
    layer.write(1, [(0, torch.ones(2, 4), torch.ones(4, 2))])
    layer.write(4, [(0, torch.full((2, 4), float("nan")), torch.ones(4, 2))])  # never read below
    x, base = torch.ones(3, 4), torch.zeros(3, 4)
    assert layer.add_to(base.clone(), x).eq(0).all()  # no selection: the base output as it is
    step.select = _select([1, 0, 1], 1)
    got = layer.add_to(base.clone(), x)
    torch.testing.assert_close(got, torch.tensor([[8.0] * 4, [0.0] * 4, [8.0] * 4]))


def test_rewriting_a_slot_replaces_the_adapter_in_it():
    step = LoraStep(select=_select([1], 1))
    layer = _slots(step, 2, [1, 1], num_slots=1, rank=1)
    layer.write(1, [(0, torch.ones(1, 2), torch.ones(1, 1)), (1, torch.ones(1, 2), torch.ones(1, 1))])
    layer.write(1, [(1, torch.ones(1, 2), torch.full((1, 1), 3.0))])
    torch.testing.assert_close(layer.add_to(torch.zeros(1, 2), torch.ones(1, 2)), torch.tensor([[0.0, 6.0]]))
