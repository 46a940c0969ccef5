"""JIT for kernel variants: content-hashed nvcc builds, cubin loading and launch, TMA descriptors.

Importing this package needs neither a GPU nor torch; the driver loads on first use.
"""

from .build import (
    BuildError,
    BuiltKernel,
    FunctionReport,
    KernelSource,
    PtxasReport,
    build,
    cache_dir,
    variant_key,
)
from .driver import CudaDriverError, CudaFunction, CudaModule, load_module
from .tensor_map import encode_tensor_map_2d, validate_tensor_map_2d

__all__ = [
    "BuildError",
    "BuiltKernel",
    "CudaDriverError",
    "CudaFunction",
    "CudaModule",
    "FunctionReport",
    "KernelSource",
    "PtxasReport",
    "build",
    "cache_dir",
    "encode_tensor_map_2d",
    "load_module",
    "validate_tensor_map_2d",
    "variant_key",
]
