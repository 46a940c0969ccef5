"""More ranks than GPUs: where each rank runs, how its buffer reaches the others (CUDA IPC), and
the reference's collectives on a gloo group.  The GPU side is the fused tier at world size 4 and 8
on 2 GPUs (``OVERSUB_RANKS="4 8" scripts/gpu_tests.sh quick tests/gpu/test_fused.py``); these check
the host logic without a GPU."""

import pytest
import torch
from helpers import rank_placement

from megamoe_cli import fused
from megamoe_cli.errors import MegaMoEError
from megamoe_cli.fused import buffer as fused_buffer
from megamoe_cli.kernel.jit import driver
from megamoe_cli.reference import layer as reference


@pytest.mark.parametrize("local_rank,local_world,gpus,expected", [
    (0, 1, 1, (0, "nccl")),
    (1, 2, 2, (1, "nccl")),
    (3, 4, 8, (3, "nccl")),   # fewer ranks than GPUs: one each
    (2, 4, 2, (0, "gloo")),   # two ranks per GPU
    (3, 4, 2, (1, "gloo")),
    (7, 8, 2, (1, "gloo")),
    (5, 8, 3, (2, "gloo")),
])
def test_rank_placement(local_rank, local_world, gpus, expected):
    assert rank_placement(local_rank, local_world, gpus) == expected


def test_rank_placement_refuses_what_cannot_be_placed():
    with pytest.raises(MegaMoEError, match="at least one GPU, got 0"):
        rank_placement(0, 2, 0)
    with pytest.raises(MegaMoEError, match=r"local rank 4 outside \[0, 4\)"):
        rank_placement(4, 4, 2)


def test_ipc_handles_keep_all_64_bytes():
    # A handle is opaque bytes, zeros included: reading the struct's char array would stop at
    # the first zero byte (and the peer's open would then fail with CUDA_ERROR_INVALID_VALUE).
    raw = bytes([0x41, 0, 0x42] + [0] * 30 + list(range(1, 32)))
    assert len(raw) == 64
    handle = driver.ipc_handle_from_bytes(raw)
    assert driver.ipc_handle_bytes(handle) == raw
    with pytest.raises(ValueError, match="64 bytes, got 63"):
        driver.ipc_handle_from_bytes(raw[:63])
    with pytest.raises(ValueError, match="64 bytes, got 3"):
        driver.ipc_open(b"abc", 0, 0)  # checked before any driver call


def _gathers(*answers):
    """A stand-in for dist.all_gather_object that answers its successive calls from ``answers``
    (each a function of the value this rank contributed)."""
    calls = iter(answers)

    def gather(out, value, group=None):
        out[:] = next(calls)(value)

    return gather


def test_map_peer_buffers_gives_every_rank_its_peers_addresses(monkeypatch):
    rank, world = 2, 4
    exported = {r: (bytes([r + 1]) * 64, 4096 * r) for r in range(world)}
    opened = []

    def export(ptr, device):
        return exported[rank]

    def open_(handle, offset, device):
        opened.append((handle, offset))
        return 0x7F0000000000 + 0x100000000 * handle[0] + offset

    def handles(value):
        assert value == exported[rank]
        return [exported[r] for r in range(world)]

    monkeypatch.setattr(driver, "ipc_export", export)
    monkeypatch.setattr(driver, "ipc_open", open_)
    monkeypatch.setattr(fused_buffer.dist, "all_gather_object", _gathers(handles, lambda value: [value] * world))
    buffer, ptrs, mapped = fused_buffer.map_peer_buffers(1024, torch.device("cpu"), rank, world, group=None)
    assert buffer.numel() == 1024 and buffer.dtype == torch.uint8
    assert ptrs[rank] == buffer.data_ptr()
    assert sorted(opened) == sorted(exported[r] for r in range(world) if r != rank)  # never its own
    assert sorted(mapped) == sorted(exported[r][0] for r in range(world) if r != rank)
    for r in range(world):
        if r != rank:
            assert ptrs[r] == 0x7F0000000000 + 0x100000000 * (r + 1) + 4096 * r


def test_map_peer_buffers_names_the_allocator_when_export_fails(monkeypatch):
    def export(ptr, device):
        raise driver.CudaDriverError("cuIpcGetMemHandle", 1, "CUDA_ERROR_INVALID_VALUE", "invalid argument")

    monkeypatch.setattr(driver, "ipc_export", export)
    monkeypatch.setattr(fused_buffer.dist, "all_gather_object", _gathers(lambda value: [(b"x" * 64, 0), value, (b"y" * 64, 0)]))
    with pytest.raises(MegaMoEError, match="rank 1: ranks share a GPU.*cudaMalloc.*expandable_segments"):
        fused_buffer.map_peer_buffers(64, torch.device("cpu"), 1, 3, group=None)


def test_map_peer_buffers_fails_on_every_rank_when_one_rank_fails(monkeypatch):
    # A peer's export failed: this rank raises too instead of waiting for it in a later collective.
    monkeypatch.setattr(driver, "ipc_export", lambda ptr, device: (b"a" * 64, 0))
    monkeypatch.setattr(driver, "ipc_open", lambda *a: pytest.fail("must not map after a peer failed"))
    monkeypatch.setattr(fused_buffer.dist, "all_gather_object",
                        _gathers(lambda value: [value, "rank 1: ranks share a GPU, ... no cudaMalloc memory"]))
    with pytest.raises(MegaMoEError, match="rank 1: ranks share a GPU"):
        fused_buffer.map_peer_buffers(64, torch.device("cpu"), 0, 2, group=None)

    # This rank maps rank 1, then fails on rank 2 (any exception type): it unmaps rank 1, waits
    # for every rank, and every rank hears why.
    closed, barriers = [], []

    def open_(handle, offset, device):
        if handle[:1] == b"c":
            raise ValueError("a handle of the wrong size")
        return 0x1000

    monkeypatch.setattr(driver, "ipc_open", open_)
    monkeypatch.setattr(driver, "ipc_close", lambda handle, device: closed.append(handle))
    monkeypatch.setattr(fused_buffer.dist, "barrier", lambda group=None: barriers.append(group))
    monkeypatch.setattr(fused_buffer.dist, "all_gather_object",
                        _gathers(lambda value: [value, (b"b" * 64, 0), (b"c" * 64, 0)], lambda value: [value, None, None]))
    with pytest.raises(MegaMoEError, match="rank 0 could not map rank 2's buffer: ValueError"):
        fused_buffer.map_peer_buffers(64, torch.device("cpu"), 0, 3, group=None)
    assert closed == [b"b" * 64] and len(barriers) == 1

    # This rank mapped everything but a peer could not: it raises as well, after unmapping.
    closed.clear(), barriers.clear()
    monkeypatch.setattr(driver, "ipc_open", lambda handle, offset, device: 0x2000)
    monkeypatch.setattr(fused_buffer.dist, "all_gather_object",
                        _gathers(lambda value: [value, (b"b" * 64, 0), (b"d" * 64, 0)],
                                 lambda value: [value, None, "rank 2 could not map rank 0's buffer: boom"]))
    with pytest.raises(MegaMoEError, match="rank 2 could not map rank 0's buffer"):
        fused_buffer.map_peer_buffers(64, torch.device("cpu"), 0, 3, group=None)
    assert sorted(closed) == [b"b" * 64, b"d" * 64] and len(barriers) == 1


def test_map_peer_buffers_reports_an_allocation_failure_to_every_rank(monkeypatch):
    # Out of memory on this rank (4 ranks on one GPU): the others hear it in the first gather.
    def empty(*args, **kwargs):
        raise RuntimeError("CUDA out of memory")

    contributed = []

    def handles(value):
        contributed.append(value)
        return [value, (b"z" * 64, 0)]

    monkeypatch.setattr(fused_buffer.torch, "empty", empty)
    monkeypatch.setattr(fused_buffer.dist, "all_gather_object", _gathers(handles))
    with pytest.raises(MegaMoEError, match="rank 0: .*RuntimeError: CUDA out of memory"):
        fused_buffer.map_peer_buffers(64, torch.device("cpu"), 0, 2, group=None)
    assert isinstance(contributed[0], str)


def test_ranks_share_gpus_by_host_and_bus():
    a, b = "0000:18:00.0", "0000:2a:00.0"
    assert not fused_buffer.ranks_share_gpus([("n1", a), ("n1", b)])
    assert fused_buffer.ranks_share_gpus([("n1", a), ("n1", b), ("n1", a)])
    assert not fused_buffer.ranks_share_gpus([("n1", a), ("n2", a)])  # the same bus id on two hosts: two GPUs


def test_ipc_mappings_are_counted_and_the_last_close_unmaps(monkeypatch):
    calls, contexts = [], []

    def call(name, *args, what=""):
        if name == "cuIpcOpenMemHandle":
            calls.append((name, driver.ipc_handle_bytes(args[0]), args[1]))
            return 0x7000  # the mapped address
        calls.append((name,) + args)

    monkeypatch.setattr(driver, "_call", call)
    monkeypatch.setattr(driver, "ensure_context", lambda device=None: contexts.append(device))
    monkeypatch.setattr(driver, "_ipc_opened", {})
    h = bytes(range(64))
    assert driver.ipc_open(h, 16, 3) == 0x7010
    assert driver.ipc_open(h, 32, 3) == 0x7020  # the same allocation again: no second mapping
    assert calls == [("cuIpcOpenMemHandle", h, driver.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)]
    assert contexts == [3, 3]  # mapped in the buffer's device's context
    driver.ipc_close(h, 3)
    assert len(calls) == 1  # still in use
    driver.ipc_close(h, 3)
    assert calls[1:] == [("cuIpcCloseMemHandle", 0x7000)]  # the mapped base, not an offset into it
    assert contexts[-1] == 3
    with pytest.raises(ValueError, match="not open"):
        driver.ipc_close(h, 3)
    driver.ipc_open(h, 0, 1)  # another device maps it on its own
    assert [c[0] for c in calls].count("cuIpcOpenMemHandle") == 2


def _bare_buffer(shares_gpus, rank=0, world_size=2):
    buf = object.__new__(fused.SymmBuffer)
    buf.shares_gpus, buf.closed, buf.group = shares_gpus, False, None
    buf.rank, buf.world_size = rank, world_size
    buf.device = torch.device("cuda", 0)
    buf._ipc_opened = [b"p" * 64, b"q" * 64]
    return buf


def test_close_unmaps_the_peers_then_waits_for_every_rank(monkeypatch):
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))
    monkeypatch.setattr(driver, "ipc_close", lambda handle, device: events.append(("close", handle[:1], device)))

    def gather(out, value, group=None):
        events.append("gather")
        out[:] = [value, None]

    monkeypatch.setattr(fused_buffer.dist, "all_gather_object", gather)
    buf = _bare_buffer(True)
    buf.close()
    assert events == ["sync", ("close", b"p", 0), ("close", b"q", 0), "gather"]
    assert buf.closed and buf._ipc_opened == []
    buf.close()  # once only
    assert len(events) == 4
    with pytest.raises(MegaMoEError, match="SymmBuffer was closed"):
        fused.mega_moe(None, None, None, buf)

    symmetric = _bare_buffer(False)  # torch's symmetric memory: nothing to unmap, still usable
    symmetric.close()
    assert not symmetric.closed and len(events) == 4


def test_close_unmaps_and_meets_the_others_even_when_the_device_failed(monkeypatch):
    def failed_sync(device=None):
        raise RuntimeError("an illegal instruction was encountered")

    closed, contributed = [], []

    def gather(out, value, group=None):
        contributed.append(value)
        out[:] = [value, None]

    monkeypatch.setattr(torch.cuda, "synchronize", failed_sync)
    monkeypatch.setattr(driver, "ipc_close", lambda handle, device: closed.append(handle))
    monkeypatch.setattr(fused_buffer.dist, "all_gather_object", gather)
    with pytest.raises(MegaMoEError, match="rank 0: the device failed.*illegal instruction"):
        _bare_buffer(True).close()
    assert len(closed) == 2 and "illegal instruction" in contributed[0]

    # A peer failed: this rank, whose own close went well, raises too.
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(fused_buffer.dist, "all_gather_object",
                        lambda out, value, group=None: out.__setitem__(slice(None), [value, "rank 1: boom"]))
    with pytest.raises(MegaMoEError, match="rank 1: boom"):
        _bare_buffer(True).close()


def test_a_new_buffer_closes_the_runners_old_one_and_the_old_runner_refuses_calls(monkeypatch):
    from types import SimpleNamespace

    from megamoe_cli.kernel.kernel_source import KernelConfig
    from megamoe_cli.layout import MoEShape

    made, closed = [], []

    class FakeBuffer:
        def __init__(self, group, *args, block_m, **kwargs):
            self.device, self.closed = torch.device("cpu"), False
            made.append(self)

        def close(self):
            closed.append(self)
            self.closed = True

    monkeypatch.setattr(fused, "SymmBuffer", FakeBuffer)
    monkeypatch.setattr(fused, "resolve_config", lambda *a: (KernelConfig(block_m=64), "default"))
    monkeypatch.setattr(fused, "transform_weights_for_mega_moe", lambda *a: (None, None))
    monkeypatch.setattr(fused_buffer.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(fused, "_BUFFERS", {})
    shape = MoEShape(hidden=512, intermediate=256, num_experts=16, num_topk=4)

    def problem(max_tokens):
        return SimpleNamespace(shape=shape, world_size=4, num_max_tokens_per_rank=max_tokens, num_tokens=8,
                               w1=None, w1_sf=None, w2=None, w2_sf=None)

    first = fused._FusedRunner(problem(128), None, {})
    again = fused._FusedRunner(problem(128), None, {})  # same buffer key: reused, nothing closed
    assert again.buf is first.buf and closed == []
    second = fused._FusedRunner(problem(256), None, {})  # a new key: the old buffer is closed first
    assert closed == [first.buf] and second.buf is made[1]
    with pytest.raises(MegaMoEError, match="SymmBuffer was closed"):
        first()


class _FakeCudaTensor:
    """Stands in for a GPU tensor on a CPU machine: what _host_staged looks at and calls."""

    is_cuda = True

    def __init__(self):
        self.moved = False

    def cpu(self):
        self.moved = True
        return torch.zeros(3)


@pytest.mark.parametrize("backend,moves", [("gloo", True), ("nccl", False)])
def test_reference_collectives_stage_gpu_tensors_on_the_host_for_gloo(monkeypatch, backend, moves):
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: backend)
    t = _FakeCudaTensor()
    out = reference._host_staged(t, group=None)
    assert t.moved is moves
    assert (out is not t) is moves
    cpu = torch.ones(2)
    assert reference._host_staged(cpu, group=None) is cpu  # host tensors stay where they are
