"""GPU tier: run with `python -m pytest tests/gpu` (world size 1) and
`torchrun --nproc-per-node N -m pytest tests/gpu` (world size N, one process per GPU).
Every rank runs the same tests in the same order; collectives line up by construction.

More ranks than GPUs (e.g. 4 or 8 ranks on 2 GPUs) run too: rank r takes GPU r % GPUs and
the process group is gloo (NCCL refuses two ranks on one GPU).  The ranks sharing a GPU are
separate CUDA contexts, which the GPU time-slices, so such a run checks the kernel's
world-size-4 and -8 logic on real hardware (correctness only; its times mean nothing)."""

import os
from datetime import timedelta

import pytest
import torch

from helpers import rank_placement

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="session")
def group():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import torch.distributed as dist

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    index, backend = rank_placement(local_rank, local_world, torch.cuda.device_count())
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    if world_size == 1:
        yield None
        return
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if backend == "gloo":
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    else:
        dist.init_process_group("nccl", timeout=timedelta(seconds=120), device_id=device)
    yield dist.group.WORLD
    dist.barrier()
    dist.destroy_process_group()
