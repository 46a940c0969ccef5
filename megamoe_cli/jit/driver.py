"""Load cubins and launch their kernels through the CUDA driver API (ctypes over libcuda.so.1).

Importing this module never touches the driver: ``libcuda.so.1`` loads on the first
call, so CPU-only machines can import everything and only fail, with a clear error,
when they try to load or launch.  Kernels take one by-value parameter
(``__grid_constant__ const Params p``); ``launch`` receives that struct's raw bytes.
"""

from __future__ import annotations

import ctypes
import json
import sys
import threading
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

from .build import PtxasReport

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0
CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1
CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3
CU_FUNC_ATTRIBUTE_NUM_REGS = 4
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED = 3
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
PARAMS_ALIGN_BYTES = 64

_c_void_pp = ctypes.POINTER(ctypes.c_void_p)


class CudaDriverError(RuntimeError):
    """A driver call returned an error; ``code`` and ``error_name`` say which."""

    def __init__(self, call: str, code: int, error_name: str, description: str):
        self.call = call
        self.code = code
        self.error_name = error_name
        super().__init__(f"{call} failed: {error_name} ({description})")


class _ClusterDim(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


class CUlaunchAttributeValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("clusterDim", _ClusterDim), ("align", ctypes.c_uint64)]


class CUlaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", CUlaunchAttributeValue)]


class CUlaunchConfig(ctypes.Structure):
    _fields_ = [
        ("gridDimX", ctypes.c_uint),
        ("gridDimY", ctypes.c_uint),
        ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint),
        ("blockDimY", ctypes.c_uint),
        ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint),
        ("hStream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(CUlaunchAttribute)),
        ("numAttrs", ctypes.c_uint),
    ]


class CUipcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


_SIGNATURES = {
    "cuInit": [ctypes.c_uint],
    "cuDriverGetVersion": [ctypes.POINTER(ctypes.c_int)],
    "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
    "cuDeviceGetCount": [ctypes.POINTER(ctypes.c_int)],
    "cuDeviceGetPCIBusId": [ctypes.c_char_p, ctypes.c_int, ctypes.c_int],
    "cuDeviceGetByPCIBusId": [ctypes.POINTER(ctypes.c_int), ctypes.c_char_p],
    "cuDeviceGetP2PAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int, ctypes.c_int],
    "cuDevicePrimaryCtxRetain": [_c_void_pp, ctypes.c_int],
    "cuCtxGetCurrent": [_c_void_pp],
    "cuCtxSetCurrent": [ctypes.c_void_p],
    "cuCtxGetDevice": [ctypes.POINTER(ctypes.c_int)],
    "cuModuleLoadData": [_c_void_pp, ctypes.c_void_p],
    "cuModuleGetFunction": [_c_void_pp, ctypes.c_void_p, ctypes.c_char_p],
    "cuModuleGetGlobal_v2": [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p, ctypes.c_char_p],
    "cuMemcpyDtoH_v2": [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t],
    "cuMemsetD8_v2": [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t],
    "cuMemGetAddressRange_v2": [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64],
    "cuIpcGetMemHandle": [ctypes.POINTER(CUipcMemHandle), ctypes.c_uint64],
    "cuIpcOpenMemHandle_v2": [ctypes.POINTER(ctypes.c_uint64), CUipcMemHandle, ctypes.c_uint],
    "cuIpcCloseMemHandle": [ctypes.c_uint64],
    "cuFuncSetAttribute": [ctypes.c_void_p, ctypes.c_int, ctypes.c_int],
    "cuFuncGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_void_p],
    "cuFuncGetParamInfo": [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)],
    "cuOccupancyMaxActiveBlocksPerMultiprocessor": [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t],
    "cuOccupancyMaxActiveClusters": [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.POINTER(CUlaunchConfig)],
    "cuLaunchKernel": [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p, _c_void_pp, _c_void_pp],
    "cuLaunchKernelEx": [ctypes.POINTER(CUlaunchConfig), ctypes.c_void_p, _c_void_pp, _c_void_pp],
    "cuTensorMapEncodeTiled": [
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_uint32,
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_uint32),
        ctypes.POINTER(ctypes.c_uint32),
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
    ],
}

_lock = threading.RLock()
_libcuda: Optional[ctypes.CDLL] = None
_functions: Dict[str, object] = {}
_primary_contexts: Dict[int, int] = {}
_modules: Dict[Tuple[str, int], "CudaModule"] = {}


def _bind(library: ctypes.CDLL, name: str):
    try:
        function = getattr(library, name)
    except AttributeError:
        raise RuntimeError(f"the CUDA driver lacks {name}; update the NVIDIA driver") from None
    function.argtypes = _SIGNATURES[name]
    function.restype = ctypes.c_int
    return function


def _describe(library: ctypes.CDLL, code: int) -> Tuple[str, str]:
    name, description = ctypes.c_char_p(), ctypes.c_char_p()
    if _bind(library, "cuGetErrorName")(code, ctypes.byref(name)) != CUDA_SUCCESS or not name.value:
        return f"CUresult {code}", "unknown error code"
    _bind(library, "cuGetErrorString")(code, ctypes.byref(description))
    return name.value.decode(), (description.value or b"").decode()


def _library() -> ctypes.CDLL:
    global _libcuda
    with _lock:
        if _libcuda is None:
            try:
                library = ctypes.CDLL("libcuda.so.1")
            except OSError as error:
                raise RuntimeError(
                    f"cannot load the CUDA driver library libcuda.so.1 ({error}); loading and launching "
                    "kernels needs an NVIDIA GPU with its driver installed"
                ) from None
            result = _bind(library, "cuInit")(0)
            if result != CUDA_SUCCESS:
                raise CudaDriverError("cuInit", result, *_describe(library, result))
            _libcuda = library
        return _libcuda


def _function(name: str):
    function = _functions.get(name)
    if function is None:
        with _lock:
            function = _functions.get(name)
            if function is None:
                function = _functions[name] = _bind(_library(), name)
    return function


def _error_text(code: int) -> Tuple[str, str]:
    return _describe(_library(), code)


def check(result: int, call: str) -> None:
    """Raise ``CudaDriverError`` naming ``call`` unless ``result`` is CUDA_SUCCESS."""
    if result != CUDA_SUCCESS:
        error_name, description = _error_text(result)
        raise CudaDriverError(call, result, error_name, description)


def _call(name: str, *args, what: str = "") -> None:
    check(_function(name)(*args), f"{name}({what})" if what else name)


def is_available() -> bool:
    """Whether the driver loads and sees at least one device."""
    try:
        count = ctypes.c_int()
        _call("cuDeviceGetCount", ctypes.byref(count))
        return count.value > 0
    except RuntimeError:
        return False


def pci_bus_id(device: int) -> str:
    """The device's PCI bus id (``domain:bus:device.function``), the same in every process."""
    out = ctypes.create_string_buffer(32)
    handle = ctypes.c_int()
    _call("cuDeviceGet", ctypes.byref(handle), device, what=f"device {device}")
    _call("cuDeviceGetPCIBusId", out, len(out), handle.value, what=f"device {device}")
    return out.value.decode()


def device_by_pci_bus_id(bus_id: str) -> Optional[int]:
    """This process's device with that PCI bus id, or None when it does not see it."""
    handle = ctypes.c_int()
    if _function("cuDeviceGetByPCIBusId")(ctypes.byref(handle), bus_id.encode()) != CUDA_SUCCESS:
        return None
    return handle.value


def peer_native_atomics(device: int, peer: int) -> bool:
    """Whether atomics from ``device`` on ``peer``'s memory are native (NVLink; PCIe usually not)."""
    value = ctypes.c_int()
    _call("cuDeviceGetP2PAttribute", ctypes.byref(value), CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED,
          device, peer, what=f"native atomics {device} -> {peer}")
    return value.value != 0


def ipc_export(ptr: int, device: int) -> Tuple[bytes, int]:
    """(IPC handle of the allocation holding device address ``ptr`` on ``device``, ptr's offset in it).

    Works on memory from cudaMalloc (PyTorch's default allocator), not on virtual-memory
    allocations (``expandable_segments``), which the driver refuses to export this way."""
    ensure_context(device)
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _call("cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size), ptr, what=f"0x{ptr:x}")
    handle = CUipcMemHandle()
    _call("cuIpcGetMemHandle", ctypes.byref(handle), base.value, what=f"allocation at 0x{base.value:x}")
    return ipc_handle_bytes(handle), ptr - base.value


def ipc_handle_bytes(handle: CUipcMemHandle) -> bytes:
    """All 64 bytes of an IPC handle (its char-array field would stop at the first zero byte)."""
    return bytes(handle)


def ipc_handle_from_bytes(raw: bytes) -> CUipcMemHandle:
    if len(raw) != ctypes.sizeof(CUipcMemHandle):
        raise ValueError(f"an IPC handle has {ctypes.sizeof(CUipcMemHandle)} bytes, got {len(raw)}")
    return CUipcMemHandle.from_buffer_copy(raw)


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
            mapped = ctypes.c_uint64()
            _call("cuIpcOpenMemHandle_v2", ctypes.byref(mapped), raw, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS,
                  what="a peer's buffer")
            entry = _ipc_opened[(device, handle)] = [mapped.value, 0]
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
    _library()
    context = ctypes.c_void_p()
    _call("cuCtxGetCurrent", ctypes.byref(context))
    if context.value and device is None:
        return context.value
    if device is None:
        device = _default_device()
    if context.value:
        current = ctypes.c_int()
        _call("cuCtxGetDevice", ctypes.byref(current))
        if current.value == device:
            return context.value
    with _lock:
        primary = _primary_contexts.get(device)
        if primary is None:
            handle = ctypes.c_int()
            _call("cuDeviceGet", ctypes.byref(handle), device, what=f"device {device}")
            retained = ctypes.c_void_p()
            _call("cuDevicePrimaryCtxRetain", ctypes.byref(retained), handle.value, what=f"device {device}")
            primary = _primary_contexts[device] = retained.value
    _call("cuCtxSetCurrent", ctypes.c_void_p(primary))
    return primary


def current_device() -> int:
    ensure_context()
    device = ctypes.c_int()
    _call("cuCtxGetDevice", ctypes.byref(device))
    return device.value


def _dims(value: Sequence[int], what: str) -> Tuple[int, int, int]:
    dims = tuple(int(v) for v in (value if isinstance(value, (tuple, list)) else (value,)))
    if not 1 <= len(dims) <= 3 or any(v < 1 for v in dims):
        raise ValueError(f"{what} must be 1 to 3 positive integers, got {value!r}")
    return dims + (1,) * (3 - len(dims))


class CudaFunction:
    """One ``__global__`` function of a loaded module."""

    def __init__(self, module: "CudaModule", name: str, handle: int):
        self.module = module
        self.name = name
        self.handle = handle
        self._params_bytes: Optional[int] = None
        self._params_checked = False

    def attribute(self, attribute: int) -> int:
        value = ctypes.c_int()
        _call("cuFuncGetAttribute", ctypes.byref(value), attribute, ctypes.c_void_p(self.handle), what=self.name)
        return value.value

    def set_attribute(self, attribute: int, value: int) -> None:
        _call("cuFuncSetAttribute", ctypes.c_void_p(self.handle), attribute, int(value), what=f"{self.name}, {attribute}={value}")

    def set_max_dynamic_smem(self, nbytes: int) -> None:
        self.set_attribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)

    @property
    def num_registers(self) -> int:
        return self.attribute(CU_FUNC_ATTRIBUTE_NUM_REGS)

    @property
    def local_size_bytes(self) -> int:
        return self.attribute(CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)

    @property
    def static_smem_bytes(self) -> int:
        return self.attribute(CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)

    def max_active_blocks_per_sm(self, block_threads: int, smem_bytes: int) -> int:
        """How many blocks of this size fit on one SM at once (sizes a persistent grid)."""
        blocks = ctypes.c_int()
        _call(
            "cuOccupancyMaxActiveBlocksPerMultiprocessor",
            ctypes.byref(blocks),
            ctypes.c_void_p(self.handle),
            int(block_threads),
            int(smem_bytes),
            what=self.name,
        )
        return blocks.value

    def max_active_clusters(self, block_threads: int, smem_bytes: int, cluster_size: int) -> int:
        """How many clusters of ``cluster_size`` blocks can be resident at once on the device
        (sizes a persistent clustered grid, where a GPC's odd SM cannot host a cluster)."""
        attribute = CUlaunchAttribute()
        attribute.id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attribute.value.clusterDim.x, attribute.value.clusterDim.y, attribute.value.clusterDim.z = cluster_size, 1, 1
        config = CUlaunchConfig(cluster_size, 1, 1, int(block_threads), 1, 1, int(smem_bytes), None,
                                ctypes.pointer(attribute), 1)
        clusters = ctypes.c_int()
        self.module.make_current()
        _call("cuOccupancyMaxActiveClusters", ctypes.byref(clusters), ctypes.c_void_p(self.handle),
              ctypes.byref(config), what=self.name)
        return clusters.value

    def params_bytes(self) -> Optional[int]:
        """Size of the kernel's one parameter, or None where the driver cannot say.

        The parameter's offset in the driver's parameter space is not part of it: a
        64-byte aligned struct may sit at a non-zero offset there.
        """
        if not self._params_checked:
            offset, size = ctypes.c_size_t(), ctypes.c_size_t()
            try:
                get_info = _function("cuFuncGetParamInfo")
            except RuntimeError:
                get_info = None
            if get_info is not None:
                handle = ctypes.c_void_p(self.handle)
                first = get_info(handle, 0, ctypes.byref(offset), ctypes.byref(size))
                if first == CUDA_SUCCESS:
                    second = get_info(handle, 1, ctypes.byref(ctypes.c_size_t()), ctypes.byref(ctypes.c_size_t()))
                    if second == CUDA_SUCCESS:
                        raise ValueError(
                            f"kernel '{self.name}' takes several parameters; launch() passes one by-value struct "
                            "(`__grid_constant__ const Params p`)"
                        )
                    self._params_bytes = size.value
                elif first == CUDA_ERROR_INVALID_VALUE:
                    self._params_bytes = 0
                else:
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
        costs one driver call (the per-call work of a layer launched eagerly, every call)."""
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
        self._kernel_params = ctypes.cast(self._pointers, _c_void_pp) if params_bytes else None
        self._handle = ctypes.c_void_p(function.handle)
        if cluster == (1, 1, 1):
            self._call = "cuLaunchKernel"
            self._config = None
        else:
            self._call = "cuLaunchKernelEx"
            self._attribute = CUlaunchAttribute()
            self._attribute.id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            dim = self._attribute.value.clusterDim
            dim.x, dim.y, dim.z = cluster
            self._config = CUlaunchConfig(*grid, *block, smem_bytes, None, ctypes.pointer(self._attribute), 1)
        self._driver = _function(self._call)

    def launch(self, stream: int) -> None:
        """Launch on ``stream`` (a CUstream handle value) with the current contents of ``params``."""
        self.function.module.make_current()
        if self._config is None:
            result = self._driver(self._handle, *self.grid, *self.block, self.smem_bytes, stream,
                                  self._kernel_params, None)
        else:
            self._config.hStream = stream
            result = self._driver(ctypes.byref(self._config), self._handle, self._kernel_params, None)
        if result != CUDA_SUCCESS:
            check(result, f"{self._call}({self.function.name}, grid={self.grid}, block={self.block}, "
                          f"smem={self.smem_bytes}, cluster={self.cluster})")


class CudaModule:
    """A cubin loaded into one context; functions are looked up once and kept."""

    def __init__(self, path: Path, handle: int, context: int):
        self.path = path
        self.handle = handle
        self.context = context
        self._functions: Dict[str, CudaFunction] = {}

    def make_current(self) -> None:
        current = ctypes.c_void_p()
        _call("cuCtxGetCurrent", ctypes.byref(current))
        if current.value != self.context:
            _call("cuCtxSetCurrent", ctypes.c_void_p(self.context))

    def global_address(self, name: str) -> Tuple[int, int]:
        """(device address, size in bytes) of the module's ``extern "C" __device__`` variable ``name``."""
        self.make_current()
        address, size = ctypes.c_uint64(), ctypes.c_size_t()
        _call("cuModuleGetGlobal_v2", ctypes.byref(address), ctypes.byref(size), ctypes.c_void_p(self.handle),
              name.encode(), what=f"{name} in {self.path}")
        return address.value, size.value

    def read_global(self, name: str) -> bytes:
        """The bytes of a module global (synchronous copy; the context's work must be done)."""
        address, size = self.global_address(name)
        data = ctypes.create_string_buffer(size)
        _call("cuMemcpyDtoH_v2", data, ctypes.c_uint64(address), ctypes.c_size_t(size), what=name)
        return data.raw

    def zero_global(self, name: str) -> None:
        address, size = self.global_address(name)
        _call("cuMemsetD8_v2", ctypes.c_uint64(address), ctypes.c_ubyte(0), ctypes.c_size_t(size), what=name)

    def get_function(self, name: str) -> CudaFunction:
        with _lock:
            function = self._functions.get(name)
            if function is None:
                self.make_current()
                handle = ctypes.c_void_p()
                result = _function("cuModuleGetFunction")(ctypes.byref(handle), ctypes.c_void_p(self.handle), name.encode())
                if result != CUDA_SUCCESS:
                    error_name, description = _error_text(result)
                    hint = _known_functions(self.path)
                    raise CudaDriverError(
                        f"cuModuleGetFunction({name!r} in {self.path}){hint}", result, error_name, description
                    )
                function = self._functions[name] = CudaFunction(self, name, handle.value)
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
            data = path.read_bytes()
            handle = ctypes.c_void_p()
            _call("cuModuleLoadData", ctypes.byref(handle), data, what=str(path))
            module = _modules[(str(path), context)] = CudaModule(path, handle.value, context)
        return module


def tensor_map_encode_tiled(*args) -> None:
    """``cuTensorMapEncodeTiled`` with the context made current first; see ``tensor_map.py``."""
    ensure_context()
    _call("cuTensorMapEncodeTiled", *args)


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
