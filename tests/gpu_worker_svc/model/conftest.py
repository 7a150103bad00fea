from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    lengths = [1, 7, 33, 70]
    return [torch.randint(0, 49152, (n,), generator=g).tolist() for n in lengths]
