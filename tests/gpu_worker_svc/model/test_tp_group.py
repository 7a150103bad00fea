"""TPGroup's ordered all-reduce: a row's sum is the ranks' parts added in rank order, whatever the
number of rows reduced with it (gloo's own all-reduce changes its order with the tensor's size)."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import torch

from gpu_worker_svc.model.parallel import destroy_tp_group, init_tp_group

WORLD = 3


def _rank(rank: int, init_file: str, results: mp.Queue) -> None:
    torch.set_num_threads(1)
    group = init_tp_group(rank, WORLD, f"file://{init_file}", ordered=True)
    rows = torch.randn(40, 576, generator=torch.Generator().manual_seed(rank))  # this rank's partial sums
    reduced = {t: group.all_reduce(rows[:t].clone())[0] for t in (1, 2, 40)}
    if rank == 0:
        # As numpy arrays, which pickle by value: a tensor goes as a file descriptor this process
        # serves, and it may have exited before the test unpickles it (CI saw FileNotFoundError).
        results.put({t: row.numpy() for t, row in reduced.items()})
    destroy_tp_group(group)


def test_ordered_all_reduce_sums_a_row_the_same_however_many_rows_come_with_it(tmp_path: Path):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ranks = [ctx.Process(target=_rank, args=(r, str(tmp_path / "init"), results)) for r in range(WORLD)]
    for p in ranks:
        p.start()
    reduced = results.get(timeout=120)
    for p in ranks:
        p.join(timeout=60)
    parts = [torch.randn(40, 576, generator=torch.Generator().manual_seed(r))[0] for r in range(WORLD)]
    want = parts[0] + parts[1] + parts[2]
    assert all(torch.equal(torch.from_numpy(row), want) for row in reduced.values())
