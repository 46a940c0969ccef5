"""Test tiers: CPU tests run everywhere; tests marked ``gpu`` are skipped where CUDA is unavailable."""

import pytest


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in gpu_items:
        item.add_marker(skip)


def _gloo_rank(rank, world_size, init_file, out_dir, fn, args):
    """One spawned rank: join a gloo group, run ``fn(rank, world_size, *args)``, save what it returns."""
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    try:
        torch.save(fn(rank, world_size, *args), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def run_gloo(tmp_path_factory):
    """``run_gloo(world_size, fn, *args)`` -> per-rank results of ``fn`` run on that many CPU gloo ranks.

    ``fn`` must be a module-level function (it is pickled into spawned processes)
    and return tensors, numbers, strings, lists or dicts of them.
    """
    import torch
    import torch.multiprocessing as mp

    def run(world_size, fn, *args):
        out_dir = tmp_path_factory.mktemp("gloo")
        mp.spawn(
            _gloo_rank,
            args=(world_size, str(out_dir / "store"), str(out_dir), fn, args),
            nprocs=world_size,
            join=True,
        )
        return [torch.load(out_dir / f"rank{r}.pt") for r in range(world_size)]

    return run
