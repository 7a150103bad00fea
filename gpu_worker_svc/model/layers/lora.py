"""LoRA deltas added to a linear layer's output for a batch whose tokens use different adapters
(SGMV-style, in torch, on any device).

A LoRA-capable linear layer holds the resident adapters' weights stacked in slots. Its output rows
are split in sub-modules (q, k and v of the fused qkv projection; gate and up), each with its own
A and B per adapter. A is stacked as [slots, sub-modules, rank, in]; each sub-module's B, scaled,
as [slots, rank, its rows], ranks padded to the layer's `rank` with zeros.

A step gives every token the slot of its adapter (0: the base model, no delta). The whole batch's
delta is then one GEMM for A over the slots in use, of which each token keeps only its own slot's
columns, and one GEMM per sub-module for B into that sub-module's rows. No loop over tokens,
requests or adapters; no multiply by the zeros between sub-modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class LoraStep:
    """Each token's adapter for the step that runs now, shared by every LoRA layer of a model (the
    runner sets it around one forward and clears it after)."""

    # [T, n] one-hot, in the activations' dtype: token t uses slot s (1..n) where column s - 1 is 1;
    # a row of zeros is the base model. None: no token of the step uses an adapter.
    select: torch.Tensor | None = None

    @property
    def active(self) -> bool:
        return self.select is not None


class LoraSlots:
    """One linear layer's adapter slots: for each of `num_slots` adapters, an A and a B of rank up to
    `rank` per sub-module, the sub-modules owning `sub_rows` output rows each, in order."""

    def __init__(
        self,
        step: LoraStep,
        in_features: int,
        sub_rows: list[int],
        num_slots: int,
        rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.step = step
        self.rank = rank
        self.subs = len(sub_rows)
        self.starts = [sum(sub_rows[:j]) for j in range(self.subs)]  # each sub-module's first output row
        self.sub_rows = sub_rows
        self.a = torch.zeros(num_slots * self.subs * rank, in_features, dtype=dtype, device=device)
        # B transposed, so that the slots in use are a contiguous run of rows for the GEMM.
        self.bt = [torch.zeros(num_slots * rank, rows, dtype=dtype, device=device) for rows in sub_rows]

    def write(self, slot: int, parts: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """Fills slot `slot` (1..) with an adapter's modules: (first output row, A [r, in], B scaled
        [rows, r]). A module that spans several sub-modules (a fused qkv_proj adapter) is split
        across them, its A in each; a sub-module no module names stays zero."""
        a_start = (slot - 1) * self.subs * self.rank
        b_start = (slot - 1) * self.rank
        self.a[a_start : a_start + self.subs * self.rank].zero_()
        for bt in self.bt:
            bt[b_start : b_start + self.rank].zero_()
        for row, a, b in parts:
            r = a.shape[0]
            for j, (start, rows) in enumerate(zip(self.starts, self.sub_rows)):
                lo, hi = max(row, start), min(row + b.shape[0], start + rows)
                if lo >= hi:
                    continue
                first = a_start + j * self.rank
                self.a[first : first + r].copy_(a)
                self.bt[j][b_start : b_start + r, lo - start : hi - start].copy_(b[lo - row : hi - row].t())

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y (the base layer's output for x, [T, out]) plus each token's adapter delta."""
        select = self.step.select
        if select is None:
            return y
        n, r = select.shape[1], self.rank
        xa = F.linear(x, self.a[: n * self.subs * r]).view(-1, n, self.subs, r).mul_(select[:, :, None, None])
        if self.subs == 1:
            return y.addmm_(xa.view(-1, n * r), self.bt[0][: n * r])
        for j, (start, rows) in enumerate(zip(self.starts, self.sub_rows)):
            y[:, start : start + rows].addmm_(xa[:, :, j].reshape(-1, n * r), self.bt[j][: n * r])
        return y
