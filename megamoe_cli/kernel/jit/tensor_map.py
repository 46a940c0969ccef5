"""TMA descriptors: 2-D ``CUtensorMap`` encoding through ``cuTensorMapEncodeTiled``.

Every rule the driver enforces is checked here first, in Python, so a bad layout fails
with a message naming the tensor and the rule instead of a bare CUDA_ERROR_INVALID_VALUE
(and so the rules are testable without a GPU).  The enums come from ``cuda.bindings.driver``,
the same binding that encodes the map.
"""

from __future__ import annotations

from typing import Dict, Sequence, Tuple

from cuda.bindings import driver as cu

from ...errors import MegaMoEError
from . import driver

TENSOR_MAP_BYTES = 128
MAX_BOX_DIM = 256
MAX_GLOBAL_DIM = 1 << 32
MAX_GLOBAL_STRIDE = 1 << 40

_DataType = cu.CUtensorMapDataType
_Swizzle = cu.CUtensorMapSwizzle
# dtype name: (CUtensorMapDataType, element bytes)
DTYPES: Dict[str, Tuple[_DataType, int]] = {
    "u8": (_DataType.CU_TENSOR_MAP_DATA_TYPE_UINT8, 1),
    "fp8": (_DataType.CU_TENSOR_MAP_DATA_TYPE_UINT8, 1),  # FP8 moves as raw bytes
    "i32": (_DataType.CU_TENSOR_MAP_DATA_TYPE_INT32, 4),
    "f32": (_DataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4),
    "bf16": (_DataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2),
}
# swizzle name: (CUtensorMapSwizzle, swizzle span in bytes; 0 = no swizzle)
SWIZZLES: Dict[str, Tuple[_Swizzle, int]] = {
    "none": (_Swizzle.CU_TENSOR_MAP_SWIZZLE_NONE, 0),
    "32b": (_Swizzle.CU_TENSOR_MAP_SWIZZLE_32B, 32),
    "64b": (_Swizzle.CU_TENSOR_MAP_SWIZZLE_64B, 64),
    "128b": (_Swizzle.CU_TENSOR_MAP_SWIZZLE_128B, 128),
}
INTERLEAVE = cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE
L2_PROMOTION = cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B
OOB_FILL = cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE

def _pair(value: Sequence[int], what: str, prefix: str) -> Tuple[int, int]:
    if not isinstance(value, (tuple, list)) or len(value) != 2 or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise MegaMoEError(f"{prefix}{what} must be two integers (inner, outer), got {value!r}")
    return int(value[0]), int(value[1])


def validate_tensor_map_2d(
    dtype: str,
    address: int,
    dims: Sequence[int],
    outer_stride_bytes: int,
    box: Sequence[int],
    swizzle: str,
    *,
    name: str = "tensor",
) -> None:
    """Raise ``MegaMoEError`` naming the broken rule; pure Python, no driver needed."""
    prefix = f"tensor map {name!r}: "
    if dtype not in DTYPES:
        raise MegaMoEError(f"{prefix}dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if swizzle not in SWIZZLES:
        raise MegaMoEError(f"{prefix}swizzle must be one of {list(SWIZZLES)}, got {swizzle!r}")
    element_bytes = DTYPES[dtype][1]
    span = SWIZZLES[swizzle][1]
    if not isinstance(address, int) or address <= 0:
        raise MegaMoEError(f"{prefix}global address must be a positive integer (a device pointer), got {address!r}")
    if address % 16:
        raise MegaMoEError(f"{prefix}global address {address:#x} must be 16-byte aligned (it is {address % 16} bytes off)")
    inner, outer = _pair(dims, "dims", prefix)
    for label, value in (("inner", inner), ("outer", outer)):
        if not 1 <= value <= MAX_GLOBAL_DIM:
            raise MegaMoEError(f"{prefix}{label} dim must be in [1, 2^32], got {value}")
    if not isinstance(outer_stride_bytes, int) or isinstance(outer_stride_bytes, bool):
        raise MegaMoEError(f"{prefix}outer stride must be an integer number of bytes, got {outer_stride_bytes!r}")
    if outer_stride_bytes % 16 or not 0 < outer_stride_bytes < MAX_GLOBAL_STRIDE:
        raise MegaMoEError(
            f"{prefix}outer stride must be a positive multiple of 16 bytes below 2^40, got {outer_stride_bytes}"
        )
    if outer_stride_bytes < inner * element_bytes:
        raise MegaMoEError(
            f"{prefix}outer stride {outer_stride_bytes} B is smaller than one row "
            f"({inner} x {element_bytes} B = {inner * element_bytes} B): rows would overlap"
        )
    box_inner, box_outer = _pair(box, "box", prefix)
    for label, value in (("inner", box_inner), ("outer", box_outer)):
        if not 1 <= value <= MAX_BOX_DIM:
            raise MegaMoEError(f"{prefix}box {label} dim must be in [1, {MAX_BOX_DIM}], got {value}")
    box_inner_bytes = box_inner * element_bytes
    if box_inner_bytes % 16:
        raise MegaMoEError(
            f"{prefix}box inner extent {box_inner} x {element_bytes} B = {box_inner_bytes} B must be a multiple of 16 B"
        )
    if span and box_inner_bytes > span:
        raise MegaMoEError(
            f"{prefix}box inner extent {box_inner_bytes} B exceeds the {swizzle} swizzle span of {span} B "
            f"(at most {span // element_bytes} {dtype} elements)"
        )


def encode_tensor_map_2d(
    dtype: str,
    address: int,
    dims: Sequence[int],
    outer_stride_bytes: int,
    box: Sequence[int],
    swizzle: str,
    *,
    name: str = "tensor",
) -> bytes:
    """Encode a 2-D tiled ``CUtensorMap`` (128 bytes) for ``address``.

    ``dims``/``box`` are (inner, outer) in elements, ``outer_stride_bytes`` the byte
    distance between rows.  Interleave none, L2 promotion 256 B, out-of-bounds
    elements read as zero, element strides 1.  Place the bytes at a 64-byte aligned
    offset of the kernel's parameter struct.
    """
    validate_tensor_map_2d(dtype, address, dims, outer_stride_bytes, box, swizzle, name=name)
    return driver.tensor_map_encode_tiled(
        DTYPES[dtype][0], 2, address, dims, (outer_stride_bytes,), box, (1, 1),
        INTERLEAVE, SWIZZLES[swizzle][0], L2_PROMOTION, OOB_FILL,
    )
