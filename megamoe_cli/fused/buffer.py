"""The symmetric buffer: one allocation per rank with the layout ``layout.build_layout`` computes,
mapped into every peer (torch symmetric memory, or CUDA IPC when ranks share a GPU)."""

from __future__ import annotations

import socket
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..errors import MegaMoEError
from ..kernel import contract
from ..kernel.kernel_source import KernelConfig
from ..layout import BufferConfig, BufferLayout, MoEShape, build_layout, workspace_bytes
from .diagnostics import describe_failure
from .inputs import INPUT_NAMES, NO_INPUTS, copy_inputs

_TORCH_DTYPES = {
    "u64": torch.int64,
    "i64": torch.int64,
    "u32": torch.int32,
    "i32": torch.int32,
    "f32": torch.float32,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
}


def group_info(group) -> Tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    if group is not None:
        raise MegaMoEError("a process group was given but torch.distributed is not initialized")
    return 0, 1


def check_peer_atomics(rank: int, bus_ids: Sequence[str], device_of: Callable[[str], Optional[int]],
                       native: Callable[[int, int], bool]) -> int:
    """Refuse a group in which this rank's GPU cannot do native atomics on a peer's memory.

    The kernel's count phase adds to the owners' counters across GPUs (system-scope atomics on
    peer memory), which are atomic only where the link supports them natively (NVLink; PCIe
    peer-to-peer usually does not).  ``bus_ids``: every rank's PCI bus id; ``device_of`` maps one
    to this process's device (None: not visible here, so not checked).  Returns the number of
    peers checked.
    """
    me = device_of(bus_ids[rank])
    if me is None:
        return 0
    checked = 0
    for peer_rank, bus in enumerate(bus_ids):
        peer = device_of(bus)
        if peer_rank == rank or peer is None or peer == me:
            continue
        if not native(me, peer):
            raise MegaMoEError(
                f"rank {rank} (GPU {bus_ids[rank]}) cannot do native atomics on rank {peer_rank}'s memory "
                f"(GPU {bus}); the fused kernel needs GPUs joined by NVLink (native peer atomics), "
                f"expected every pair of ranks to support them"
            )
        checked += 1
    return checked


def ranks_share_gpus(gpus: Sequence[Tuple[str, str]]) -> bool:
    """Whether two ranks of a group use one GPU, from every rank's (host name, PCI bus id)."""
    return len(set(gpus)) < len(gpus)


def map_peer_buffers(nbytes: int, device: torch.device, rank: int, world_size: int,
                     group) -> Tuple[torch.Tensor, List[int], List[bytes]]:
    """A buffer per rank, each mapped into every rank's address space through CUDA IPC.

    For groups with more ranks than GPUs (two ranks on one GPU), which torch's symmetric memory
    refuses: a test and debugging setup (the ranks sharing a GPU are separate contexts that the
    GPU time-slices), so correctness only.  Returns this rank's buffer, every rank's address and
    the peers' handles this rank opened (``SymmBuffer.close`` closes them).  A rank whose export
    or mapping fails tells the others, so every rank raises instead of waiting for it."""
    from ..kernel.jit import driver

    try:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        mine: object = driver.ipc_export(buffer.data_ptr(), device.index)
    except Exception as error:  # every rank must reach the gather below, whatever failed
        mine = (f"rank {rank}: ranks share a GPU, so the buffer is mapped through CUDA IPC, which needs memory "
                f"from cudaMalloc; got {type(error).__name__}: {error} (is PYTORCH_CUDA_ALLOC_CONF=expandable_segments "
                f"set? is the GPU out of memory?)")
    handles: List[object] = [None] * world_size
    dist.all_gather_object(handles, mine, group=group)
    failed = [h for h in handles if isinstance(h, str)]
    if failed:
        raise MegaMoEError("; ".join(failed))
    ptrs: List[int] = []
    opened: List[bytes] = []
    error = None
    for r in range(world_size):
        if r == rank:
            ptrs.append(buffer.data_ptr())
            continue
        try:
            ptrs.append(driver.ipc_open(handles[r][0], handles[r][1], device.index))
            opened.append(handles[r][0])
        except Exception as exc:
            error = f"rank {rank} could not map rank {r}'s buffer: {type(exc).__name__}: {exc}"
            break
    errors: List[Optional[str]] = [None] * world_size
    dist.all_gather_object(errors, error, group=group)
    if any(errors):  # every rank sees the same list: all of them unmap, wait for each other and raise
        for h in opened:
            try:
                driver.ipc_close(h, device.index)
            except Exception:
                pass  # the error being raised matters more; the mapping goes with the process
        dist.barrier(group=group)  # no rank frees its buffer while a peer still maps it
        raise MegaMoEError("; ".join(e for e in errors if e))
    return buffer, ptrs, opened


class SymmBuffer:
    """One rank's symmetric buffer (identical layout on every rank of ``group``).

    Input views: ``x`` (fp8 [T, hidden]), ``x_sf`` (f32 [T, hidden/128]), ``topk_idx`` (int64
    [T, topk], -1 = no expert), ``topk_weights`` (f32 [T, topk]).  Given to ``mega_moe``, the
    inputs are copied into them by the kernel; otherwise the caller fills them before each call
    (``fill`` copies all four, in one launch up to 16 MiB of x, or the producing ops write into
    them directly).  Keep the object alive while kernels use it.

    ``block_m``: the largest pool block it serves; the pool is padded for it, and every kernel
    config with a supported block_m up to it runs on this buffer, so the default (the largest
    supported) serves the configs ``mega_moe`` chooses for any token count, decode and prefill.
    ``weights`` ("fp8" or "fp4", MXFP4) and ``activation_clamp`` (the SwiGLU clamp, 0: none) say
    which kernel the layer's weights need; the layout does not depend on them.
    """

    def __init__(
        self,
        group,
        num_experts: int,
        num_max_tokens_per_rank: int,
        num_topk: int,
        hidden: int,
        intermediate: int,
        *,
        block_m: int = max(contract.SUPPORTED_BLOCK_M),
        weights: str = "fp8",
        activation_clamp: float = 0.0,
        device: Optional[torch.device] = None,
    ):
        self.group = group
        self.rank, self.world_size = group_info(group)
        self.config = BufferConfig(
            self.world_size,
            num_max_tokens_per_rank,
            MoEShape(hidden=hidden, intermediate=intermediate, num_experts=num_experts, num_topk=num_topk,
                     weights=weights, activation_clamp=activation_clamp),
            block_m,
        )
        self.layout: BufferLayout = build_layout(self.config)
        if device is None and not torch.cuda.is_available():
            raise MegaMoEError("SymmBuffer needs a CUDA device, but torch sees none")
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        if self.device.type != "cuda":
            raise MegaMoEError(f"SymmBuffer needs a CUDA device, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        nbytes = self.layout.total_bytes
        self.handle = None
        self.shares_gpus = False  # ranks share a GPU: buffers mapped through CUDA IPC (map_peer_buffers)
        self._ipc_opened: List[bytes] = []  # the peers' buffers this rank mapped (shares_gpus)
        self.closed = False
        if self.world_size == 1:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            ptrs = [self.buffer.data_ptr()]
        else:
            import torch.distributed._symmetric_memory as symm_mem

            from ..kernel.jit import driver

            group_obj = group if group is not None else dist.group.WORLD
            gpus: List[Optional[Tuple[str, str]]] = [None] * self.world_size
            dist.all_gather_object(gpus, (socket.gethostname(), driver.pci_bus_id(self.device.index)), group=group_obj)
            bus_ids = [bus for _, bus in gpus]
            check_peer_atomics(self.rank, bus_ids, driver.device_by_pci_bus_id, driver.peer_native_atomics)
            self.shares_gpus = ranks_share_gpus(gpus)
            if self.shares_gpus:
                self.buffer, ptrs, self._ipc_opened = map_peer_buffers(nbytes, self.device, self.rank,
                                                                       self.world_size, group_obj)
            else:
                self.buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
                self.handle = symm_mem.rendezvous(self.buffer, group_obj)
                ptrs = list(self.handle.buffer_ptrs)
        self.peer_deltas = [int(ptr) - int(ptrs[self.rank]) for ptr in ptrs]
        # Counters start at zero once; the kernel returns them to zero after every call.
        self.buffer[: workspace_bytes(self.layout)].zero_()
        self.diag = torch.zeros(contract.DIAGNOSTIC_RECORD_BYTES // 8, dtype=torch.int64, pin_memory=True)
        torch.cuda.synchronize(self.device)
        if self.world_size > 1:
            dist.barrier(group=group)
        # mega_moe's launch plans (fused.launch.LaunchPlan, which reads this buffer), kept for the
        # buffer's life; the buffer itself never reads them.
        self.plans: Dict[tuple, object] = {}
        # mega_moe's config choice per num_tokens_bound (None: the capacity), and per token
        # bucket with where it came from ("tuned" or "default"): fused.call_config
        self.gpu_name = torch.cuda.get_device_name(self.device)
        self.call_configs: Dict[Optional[int], KernelConfig] = {}
        self.bucket_configs: Dict[int, Tuple[KernelConfig, str]] = {}
        self.x = self.view("x")
        self.x_sf = self.view("x_sf")
        self.topk_idx = self.view("topk_idx")
        self.topk_weights = self.view("topk_weights")
        self.inputs = (self.x, self.x_sf, self.topk_idx, self.topk_weights)  # in INPUT_NAMES order
        # Fixed for the buffer's life; every eager call given inputs compares against them.
        self.input_ptrs = tuple(v.data_ptr() for v in self.inputs)
        self.span = (self.buffer.data_ptr(), self.buffer.data_ptr() + self.nbytes)

    def close(self) -> None:
        """Unmap the peers' buffers (collective: every rank of the group calls it).

        Only buffers mapped through CUDA IPC (``shares_gpus``) hold mappings of their own: each
        rank waits for its device, unmaps its peers' buffers, then waits for every rank, so that
        no peer still maps this rank's memory when it is freed; such a buffer then refuses further
        calls (the layer runner refuses its graph replays too; a graph captured elsewhere is not checked).
        Symmetric-memory buffers are left to torch: for them this does nothing."""
        if self.closed or not self.shares_gpus:
            return
        self.closed = True
        from ..kernel.jit import driver

        error = None
        try:
            torch.cuda.synchronize(self.device)
        except Exception as exc:  # a failed kernel: unmap anyway, and say so after the others did too
            error = f"rank {self.rank}: the device failed before its peers' buffers were unmapped: {exc}"
        for handle in self._ipc_opened:
            try:
                driver.ipc_close(handle, self.device.index)
            except Exception as exc:
                error = error or f"rank {self.rank} could not unmap a peer's buffer: {exc}"
        self._ipc_opened = []
        # The gather is the barrier: no rank frees its buffer while a peer still maps it, and a
        # rank that failed does not leave the others waiting.
        errors: List[Optional[str]] = [None] * self.world_size
        dist.all_gather_object(errors, error, group=self.group)
        if any(errors):
            raise MegaMoEError("SymmBuffer.close: " + "; ".join(e for e in errors if e))

    def fill(self, x: torch.Tensor, x_sf: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> int:
        """Copy one call's inputs into the views (one device launch; two when x is over 16 MiB);
        returns the token count."""
        return copy_inputs(self.config, self.device, self.inputs,
                           (x, x_sf, topk_idx, topk_weights))

    def view(self, name: str) -> torch.Tensor:
        seg = self.layout.segment(name)
        flat = self.buffer[seg.offset : seg.offset + seg.nbytes]
        dtype = _TORCH_DTYPES[seg.dtype]
        return flat.view(dtype).view(*seg.shape)

    @property
    def nbytes(self) -> int:
        return self.layout.total_bytes

    def diagnostic(self) -> Optional[str]:
        """The kernel's failure record, if a launch on this buffer failed (readable after a trap)."""
        return describe_failure(self.diag.numpy().tobytes())


def input_addresses(buf: SymmBuffer, given: Sequence[torch.Tensor]) -> Optional[Tuple[int, int, int, int]]:
    """What the kernel copies from: the four inputs' addresses; zeros when they are the buffer's
    own views already (nothing to copy); None when one is not 16-byte aligned (the caller copies
    them instead).  An input elsewhere inside the symmetric buffer is refused: the kernel's copy
    would overwrite rows it is still reading."""
    x, x_sf, topk_idx, topk_weights = given
    addresses = (x.data_ptr(), x_sf.data_ptr(), topk_idx.data_ptr(), topk_weights.data_ptr())
    if addresses == buf.input_ptrs:
        return NO_INPUTS
    lo, hi = buf.span
    for name, t, a in zip(INPUT_NAMES, given, addresses):
        if a < hi and a + t.nbytes > lo and t.nbytes:
            raise MegaMoEError(
                f"mega_moe: {name} lies inside the symmetric buffer; pass the buffer's own views (buf.x[:n], ...) "
                "all four, or tensors outside it"
            )
    if any(a % 16 for a in addresses):
        return None
    return addresses
