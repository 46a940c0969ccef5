"""GPU tier: run with `python -m pytest tests/gpu` (world size 1) and
`torchrun --nproc-per-node N -m pytest tests/gpu` (world size N, one process per GPU).
Every rank runs the same tests in the same order; collectives line up by construction."""

import os
from datetime import timedelta

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="session")
def group():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import torch.distributed as dist

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    if world_size == 1:
        yield None
        return
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    dist.init_process_group("nccl", timeout=timedelta(seconds=120), device_id=torch.device("cuda", local_rank))
    yield dist.group.WORLD
    dist.barrier()
    dist.destroy_process_group()
