"""Load cubins and launch their kernels through the CUDA driver API (``cuda.bindings.driver``).

The binding is NVIDIA's cuda-python package (``cuda-bindings``, which CUDA builds of torch
depend on); it imports without a GPU and opens ``libcuda.so.1`` on the first driver call, so
CPU-only machines import everything here and only fail, with a clear error, when they try to
load or launch.  Kernels take one by-value parameter (``__grid_constant__ const Params p``);
``launch`` receives that struct's raw bytes.
"""

from __future__ import annotations

import ctypes
import json
import sys
import threading
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

from cuda.bindings import driver as cu

from .build import PtxasReport

CUDA_SUCCESS = cu.CUresult.CUDA_SUCCESS
CUDA_ERROR_INVALID_VALUE = cu.CUresult.CUDA_ERROR_INVALID_VALUE
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = int(cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
PARAMS_ALIGN_BYTES = 64
IPC_HANDLE_BYTES = 64  # CU_IPC_HANDLE_SIZE
TENSOR_MAP_BYTES = 128  # sizeof(CUtensorMap)

_Attribute = cu.CUfunction_attribute


class CudaDriverError(RuntimeError):
    """A driver call returned an error; ``code`` and ``error_name`` say which."""

    def __init__(self, call: str, code: int, error_name: str, description: str):
        self.call = call
        self.code = code
        self.error_name = error_name
        super().__init__(f"{call} failed: {error_name} ({description})")


_lock = threading.RLock()
_initialized = False
_primary_contexts: Dict[int, "cu.CUcontext"] = {}
_modules: Dict[Tuple[str, int], "CudaModule"] = {}


def _init() -> None:
    """Open the driver and ``cuInit`` it once; without a driver, one error saying so.

    The binding raises its own loader error (not a CUresult) when ``libcuda.so.1`` is missing."""
    global _initialized
    if _initialized:
        return
    with _lock:
        if _initialized:
            return
        try:
            (result,) = cu.cuInit(0)
        except Exception as error:  # the binding's loader: no libcuda.so.1, or one too old for it
            raise RuntimeError(
                f"cannot load the CUDA driver library libcuda.so.1 ({type(error).__name__}: {error}); loading "
                "and launching kernels needs an NVIDIA GPU with its driver installed"
            ) from None
        if result != CUDA_SUCCESS:
            raise CudaDriverError("cuInit", int(result), *_describe(result))
        _initialized = True


def _describe(result) -> Tuple[str, str]:
    error, name = cu.cuGetErrorName(result)
    if error != CUDA_SUCCESS or not name:
        return f"CUresult {int(result)}", "unknown error code"
    _, description = cu.cuGetErrorString(result)
    return name.decode(), (description or b"").decode()


def _error_text(result) -> Tuple[str, str]:
    _init()
    return _describe(result)


def check(result, call: str) -> None:
    """Raise ``CudaDriverError`` naming ``call`` unless ``result`` is CUDA_SUCCESS."""
    if result != CUDA_SUCCESS:
        error_name, description = _error_text(result)
        raise CudaDriverError(call, int(result), error_name, description)


def _call(name: str, *args, what: str = ""):
    """``cu.<name>(*args)``, its CUresult checked; returns the call's outputs (one value, a tuple
    of several, or None)."""
    _init()
    result, *outputs = getattr(cu, name)(*args)
    check(result, f"{name}({what})" if what else name)
    if not outputs:
        return None
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def is_available() -> bool:
    """Whether the driver loads and sees at least one device."""
    try:
        return _call("cuDeviceGetCount") > 0
    except RuntimeError:
        return False


def pci_bus_id(device: int) -> str:
    """The device's PCI bus id (``domain:bus:device.function``), the same in every process."""
    handle = _call("cuDeviceGet", device, what=f"device {device}")
    raw = _call("cuDeviceGetPCIBusId", 32, handle, what=f"device {device}")
    return raw.split(b"\0", 1)[0].decode()


def device_by_pci_bus_id(bus_id: str) -> Optional[int]:
    """This process's device with that PCI bus id, or None when it does not see it."""
    _init()
    result, handle = cu.cuDeviceGetByPCIBusId(bus_id.encode())
    if result != CUDA_SUCCESS:
        return None
    return int(handle)


def peer_native_atomics(device: int, peer: int) -> bool:
    """Whether atomics from ``device`` on ``peer``'s memory are native (NVLink; PCIe usually not)."""
    value = _call("cuDeviceGetP2PAttribute", cu.CUdevice_P2PAttribute.CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED,
                  device, peer, what=f"native atomics {device} -> {peer}")
    return value != 0


def ipc_export(ptr: int, device: int) -> Tuple[bytes, int]:
    """(IPC handle of the allocation holding device address ``ptr`` on ``device``, ptr's offset in it).

    Works on memory from cudaMalloc (PyTorch's default allocator), not on virtual-memory
    allocations (``expandable_segments``), which the driver refuses to export this way."""
    ensure_context(device)
    base, _ = _call("cuMemGetAddressRange", ptr, what=f"0x{ptr:x}")
    handle = _call("cuIpcGetMemHandle", base, what=f"allocation at 0x{int(base):x}")
    return ipc_handle_bytes(handle), ptr - int(base)


def ipc_handle_bytes(handle: "cu.CUipcMemHandle") -> bytes:
    """All 64 bytes of an IPC handle (opaque bytes, zeros included)."""
    return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)


def ipc_handle_from_bytes(raw: bytes) -> "cu.CUipcMemHandle":
    if len(raw) != IPC_HANDLE_BYTES:
        raise ValueError(f"an IPC handle has {IPC_HANDLE_BYTES} bytes, got {len(raw)}")
    handle = cu.CUipcMemHandle()
    ctypes.memmove(handle.getPtr(), raw, IPC_HANDLE_BYTES)
    return handle


# (device, handle) -> [address where it is mapped, number of ipc_open calls not yet closed]
_ipc_opened: Dict[Tuple[int, bytes], list] = {}


def ipc_open(handle: bytes, offset: int, device: int) -> int:
    """``device``'s address of another process's allocation (``ipc_export``) plus ``offset``.

    Mapped in ``device``'s primary context (left current: callers pass the device they run
    on) with peer access enabled as needed, so its kernels reach the allocation whether it
    lives on that GPU or on an NVLink peer.  Mapped once per (device, allocation) and
    counted: every ``ipc_open`` needs one ``ipc_close``, and the last one unmaps it (an
    exporter's allocator may hand the same allocation out again, to a second buffer, while
    the first is still mapped)."""
    raw = ipc_handle_from_bytes(handle)
    ensure_context(device)
    with _lock:
        entry = _ipc_opened.get((device, handle))
        if entry is None:
            mapped = _call("cuIpcOpenMemHandle", raw, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, what="a peer's buffer")
            entry = _ipc_opened[(device, handle)] = [int(mapped), 0]
        entry[1] += 1
    return entry[0] + offset


def ipc_close(handle: bytes, device: int) -> None:
    """Undo one ``ipc_open`` of ``handle`` on ``device``; the last one unmaps the allocation."""
    with _lock:
        entry = _ipc_opened.get((device, handle))
        if entry is None:
            raise ValueError("ipc_close: that handle is not open on this device")
        entry[1] -= 1
        if entry[1] == 0:
            del _ipc_opened[(device, handle)]
            ensure_context(device)
            _call("cuIpcCloseMemHandle", entry[0], what="a peer's buffer")


def _default_device() -> int:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.init()
        return torch.cuda.current_device()
    return 0


def ensure_context(device: Optional[int] = None) -> int:
    """Return the current context, making the device's primary context current if there is none.

    The primary context is the one the CUDA runtime (and so PyTorch) uses, so modules
    loaded here and tensors allocated by PyTorch share one address space.
    """
    context = int(_call("cuCtxGetCurrent"))
    if context and device is None:
        return context
    if device is None:
        device = _default_device()
    if context and int(_call("cuCtxGetDevice")) == device:
        return context
    with _lock:
        primary = _primary_contexts.get(device)
        if primary is None:
            handle = _call("cuDeviceGet", device, what=f"device {device}")
            primary = _primary_contexts[device] = _call("cuDevicePrimaryCtxRetain", handle, what=f"device {device}")
    _call("cuCtxSetCurrent", primary)
    return int(primary)


def current_device() -> int:
    ensure_context()
    return int(_call("cuCtxGetDevice"))


def _dims(value: Sequence[int], what: str) -> Tuple[int, int, int]:
    dims = tuple(int(v) for v in (value if isinstance(value, (tuple, list)) else (value,)))
    if not 1 <= len(dims) <= 3 or any(v < 1 for v in dims):
        raise ValueError(f"{what} must be 1 to 3 positive integers, got {value!r}")
    return dims + (1,) * (3 - len(dims))


def _cluster_config(grid, block, smem_bytes: int, cluster) -> Tuple["cu.CUlaunchConfig", "cu.CUlaunchAttribute"]:
    """A launch config carrying one cluster-dimension attribute (kept with it: the config points at it)."""
    attribute = cu.CUlaunchAttribute()
    attribute.id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    dim = attribute.value.clusterDim
    dim.x, dim.y, dim.z = cluster
    config = cu.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block
    config.sharedMemBytes = smem_bytes
    config.hStream = 0
    config.attrs = [attribute]
    config.numAttrs = 1
    return config, attribute


class CudaFunction:
    """One ``__global__`` function of a loaded module."""

    def __init__(self, module: "CudaModule", name: str, handle: int):
        self.module = module
        self.name = name
        self.handle = handle
        self._function = cu.CUfunction(handle)
        self._params_bytes: Optional[int] = None
        self._params_checked = False

    def attribute(self, attribute: "cu.CUfunction_attribute") -> int:
        return int(_call("cuFuncGetAttribute", attribute, self._function, what=self.name))

    def set_attribute(self, attribute: "cu.CUfunction_attribute", value: int) -> None:
        _call("cuFuncSetAttribute", self._function, attribute, int(value), what=f"{self.name}, {attribute.name}={value}")

    def set_max_dynamic_smem(self, nbytes: int) -> None:
        self.set_attribute(_Attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)

    @property
    def num_registers(self) -> int:
        return self.attribute(_Attribute.CU_FUNC_ATTRIBUTE_NUM_REGS)

    @property
    def local_size_bytes(self) -> int:
        return self.attribute(_Attribute.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)

    @property
    def static_smem_bytes(self) -> int:
        return self.attribute(_Attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)

    def max_active_blocks_per_sm(self, block_threads: int, smem_bytes: int) -> int:
        """How many blocks of this size fit on one SM at once (sizes a persistent grid)."""
        return int(_call("cuOccupancyMaxActiveBlocksPerMultiprocessor", self._function, int(block_threads),
                         int(smem_bytes), what=self.name))

    def max_active_clusters(self, block_threads: int, smem_bytes: int, cluster_size: int) -> int:
        """How many clusters of ``cluster_size`` blocks can be resident at once on the device
        (sizes a persistent clustered grid, where a GPC's odd SM cannot host a cluster)."""
        config, _attribute = _cluster_config((cluster_size, 1, 1), (int(block_threads), 1, 1), int(smem_bytes),
                                             (cluster_size, 1, 1))
        self.module.make_current()
        return int(_call("cuOccupancyMaxActiveClusters", self._function, config, what=self.name))

    def params_bytes(self) -> Optional[int]:
        """Size of the kernel's one parameter, or None where the driver cannot say.

        The parameter's offset in the driver's parameter space is not part of it: a
        64-byte aligned struct may sit at a non-zero offset there.
        """
        if not self._params_checked:
            _init()
            try:
                first, _offset, size = cu.cuFuncGetParamInfo(self._function, 0)
            except RuntimeError:  # a driver older than cuFuncGetParamInfo (12.4): the binding cannot find it
                first = None
            if first == CUDA_SUCCESS:
                if cu.cuFuncGetParamInfo(self._function, 1)[0] == CUDA_SUCCESS:
                    raise ValueError(
                        f"kernel '{self.name}' takes several parameters; launch() passes one by-value struct "
                        "(`__grid_constant__ const Params p`)"
                    )
                self._params_bytes = int(size)
            elif first == CUDA_ERROR_INVALID_VALUE:
                self._params_bytes = 0
            elif first is not None:
                check(first, f"cuFuncGetParamInfo({self.name})")
            self._params_checked = True
        return self._params_bytes

    def prepare(
        self,
        grid: Sequence[int],
        block: Sequence[int],
        smem_bytes: int,
        params_bytes: int,
        cluster: Sequence[int] = (1, 1, 1),
    ) -> "PreparedLaunch":
        """Check a launch shape once and keep everything a launch of it needs; the caller writes
        the parameter bytes into ``PreparedLaunch.params`` and calls ``launch(stream)``, which
        costs one launch call (the per-call work of a layer launched eagerly, every call)."""
        grid3, block3, cluster3 = _dims(grid, "grid"), _dims(block, "block"), _dims(cluster, "cluster")
        if any(g % c for g, c in zip(grid3, cluster3)):
            raise ValueError(f"kernel '{self.name}': grid {grid3} is not a multiple of cluster {cluster3}")
        expected = self.params_bytes()
        if expected is not None and params_bytes != expected:
            raise ValueError(f"kernel '{self.name}' takes a {expected}-byte parameter block, got {params_bytes} bytes")
        return PreparedLaunch(self, grid3, block3, int(smem_bytes), int(params_bytes), cluster3)

    def launch(
        self,
        grid: Sequence[int],
        block: Sequence[int],
        smem_bytes: int,
        stream: int,
        params: bytes,
        cluster: Sequence[int] = (1, 1, 1),
    ) -> None:
        """Launch on ``stream`` (a CUstream handle value, e.g. ``torch.cuda.current_stream().cuda_stream``).

        ``params`` are the raw bytes of the kernel's one by-value parameter; they are copied
        into a 64-byte aligned buffer (the struct may hold CUtensorMaps) and the driver copies
        them again at launch, so the caller may reuse them at once.
        """
        params = bytes(params)
        prepared = self.prepare(grid, block, smem_bytes, len(params), cluster)
        prepared.params[:] = params
        prepared.launch(stream)


class PreparedLaunch:
    """One launch shape of a function with its parameter block in 64-byte aligned host memory.

    ``params`` is a writable view of that block; the driver copies it when ``launch`` is called,
    so it may be rewritten as soon as ``launch`` returns (not while another thread launches).
    The driver is handed the address of a one-entry pointer array to that block (an integer),
    so a launch builds no argument objects: the binding passes the address straight through.
    """

    def __init__(self, function: CudaFunction, grid: Tuple[int, int, int], block: Tuple[int, int, int],
                 smem_bytes: int, params_bytes: int, cluster: Tuple[int, int, int]):
        self.function = function
        self.grid, self.block, self.cluster, self.smem_bytes = grid, block, cluster, smem_bytes
        self._storage = ctypes.create_string_buffer(params_bytes + PARAMS_ALIGN_BYTES)
        address = (ctypes.addressof(self._storage) + PARAMS_ALIGN_BYTES - 1) & ~(PARAMS_ALIGN_BYTES - 1)
        self.params = memoryview((ctypes.c_char * params_bytes).from_address(address)).cast("B") if params_bytes \
            else memoryview(bytearray())
        self._pointers = (ctypes.c_void_p * 1)(address)
        self._kernel_params = ctypes.addressof(self._pointers) if params_bytes else None
        self._function = function._function
        self._module = function.module
        self._gx, self._gy, self._gz = grid
        self._bx, self._by, self._bz = block
        if cluster == (1, 1, 1):
            self._call = "cuLaunchKernel"
            self._config = None
        else:
            self._call = "cuLaunchKernelEx"
            self._config, self._attribute = _cluster_config(grid, block, smem_bytes, cluster)
        _init()
        self._driver = getattr(cu, self._call)

    def launch(self, stream: int) -> None:
        """Launch on ``stream`` (a CUstream handle value) with the current contents of ``params``."""
        self._module.make_current()
        if self._config is None:
            (result,) = self._driver(self._function, self._gx, self._gy, self._gz, self._bx, self._by, self._bz,
                                     self.smem_bytes, stream, self._kernel_params, 0)
        else:
            self._config.hStream = stream
            (result,) = self._driver(self._config, self._function, self._kernel_params, 0)
        if result != CUDA_SUCCESS:
            check(result, f"{self._call}({self.function.name}, grid={self.grid}, block={self.block}, "
                          f"smem={self.smem_bytes}, cluster={self.cluster})")


class CudaModule:
    """A cubin loaded into one context; functions are looked up once and kept."""

    def __init__(self, path: Path, handle: int, context: int):
        self.path = path
        self.handle = handle
        self.context = context
        self._module = cu.CUmodule(handle)
        self._context = cu.CUcontext(context)
        self._functions: Dict[str, CudaFunction] = {}

    def make_current(self) -> None:
        """Make the module's context current if it is not (a thread may have switched devices);
        the check is one cheap driver call, which the eager launch path pays every call."""
        result, current = cu.cuCtxGetCurrent()
        if result != CUDA_SUCCESS or int(current) != self.context:
            check(result, "cuCtxGetCurrent")
            _call("cuCtxSetCurrent", self._context)

    def global_address(self, name: str) -> Tuple[int, int]:
        """(device address, size in bytes) of the module's ``extern "C" __device__`` variable ``name``."""
        self.make_current()
        address, size = _call("cuModuleGetGlobal", self._module, name.encode(), what=f"{name} in {self.path}")
        return int(address), int(size)

    def read_global(self, name: str) -> bytes:
        """The bytes of a module global (synchronous copy; the context's work must be done)."""
        address, size = self.global_address(name)
        data = ctypes.create_string_buffer(size)
        _call("cuMemcpyDtoH", ctypes.addressof(data), address, size, what=name)
        return data.raw

    def zero_global(self, name: str) -> None:
        address, size = self.global_address(name)
        _call("cuMemsetD8", address, 0, size, what=name)

    def get_function(self, name: str) -> CudaFunction:
        with _lock:
            function = self._functions.get(name)
            if function is None:
                self.make_current()
                result, handle = cu.cuModuleGetFunction(self._module, name.encode())
                if result != CUDA_SUCCESS:
                    error_name, description = _error_text(result)
                    hint = _known_functions(self.path)
                    raise CudaDriverError(
                        f"cuModuleGetFunction({name!r} in {self.path}){hint}", int(result), error_name, description
                    )
                function = self._functions[name] = CudaFunction(self, name, int(handle))
            return function


def _known_functions(cubin_path: Path) -> str:
    try:
        data = json.loads((cubin_path.parent / "report.json").read_text())
        entries = sorted(PtxasReport.from_dict(data["report"]).entries)
    except (OSError, ValueError, KeyError):
        return ""
    return f"; the module's entry functions are {entries}"


def load_module(cubin_path, device: Optional[int] = None) -> CudaModule:
    """Load a cubin into the current context (or ``device``'s primary context); cached per path and context."""
    path = Path(cubin_path).resolve()
    context = ensure_context(device)
    with _lock:
        module = _modules.get((str(path), context))
        if module is None:
            image = ctypes.create_string_buffer(path.read_bytes())  # the driver reads it during the call
            handle = _call("cuModuleLoadData", ctypes.addressof(image), what=str(path))
            module = _modules[(str(path), context)] = CudaModule(path, int(handle), context)
        return module


def tensor_map_encode_tiled(data_type, rank: int, address: int, dims: Sequence[int], strides: Sequence[int],
                            box: Sequence[int], element_strides: Sequence[int], interleave, swizzle, l2_promotion,
                            oob_fill) -> bytes:
    """``cuTensorMapEncodeTiled`` with the context made current first: the 128 bytes of the
    ``CUtensorMap`` (see ``tensor_map.py``)."""
    ensure_context()
    u64, u32 = cu.cuuint64_t, cu.cuuint32_t  # the binding takes its own integer types in these arrays
    tensor_map = _call("cuTensorMapEncodeTiled", data_type, rank, address, [u64(v) for v in dims],
                       [u64(v) for v in strides], [u32(v) for v in box], [u32(v) for v in element_strides],
                       interleave, swizzle, l2_promotion, oob_fill)
    return ctypes.string_at(tensor_map.getPtr(), TENSOR_MAP_BYTES)


__all__ = [
    "CudaDriverError",
    "CudaFunction",
    "CudaModule",
    "check",
    "current_device",
    "ensure_context",
    "is_available",
    "load_module",
]
