"""Spawned CPU gloo ranks for multi-rank tests (shared by the reference and baseline tests)."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank_main(rank, world_size, store, out_dir, worker, args):
    """One spawned rank: join the gloo group, save what ``worker(rank, world_size, *args)`` returns."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    try:
        torch.save(worker(rank, world_size, *args), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_gloo(tmp_dir, world_size, worker, *args):
    """Per-rank results of ``worker`` (a module-level function, so it pickles) on spawned ranks."""
    mp.spawn(_rank_main, args=(world_size, str(tmp_dir / "store"), str(tmp_dir), worker, args), nprocs=world_size)
    return [torch.load(tmp_dir / f"rank{r}.pt") for r in range(world_size)]
