"""The expert weight formats, spelled once: ``WeightFormat``.

The module (``MegaMoE(weights=...)``), the functional API (``SymmBuffer(weights=...)``, through
``MoEShape``), the CLI (``--weights``) and sweep files read a format through
:meth:`WeightFormat.parse`, which takes the member or any of its spellings:

| member | value (stored) | also read as | what it is |
|---|---|---|---|
| ``WeightFormat.FP8`` | ``fp8`` | | FP8 e4m3 with one FP32 scale per 128x128 block (DeepSeek-V3) |
| ``WeightFormat.MXFP4`` | ``fp4`` | ``mxfp4`` | e2m1 packed two per byte, one UE8M0 scale per 32 along K (DeepSeek-V4) |

The value is what result rows, tuned-config keys, kernel variant names and ``MoEShape.weights``
hold, so files written before the enum existed read the same.  No torch here: the CLI builds its
``--help`` from this module.
"""

from __future__ import annotations

from enum import Enum
from typing import Tuple, Union

from .errors import MegaMoEError


class WeightFormat(str, Enum):
    """An expert weight format; compares equal to its value (``WeightFormat.MXFP4 == "fp4"``)."""

    FP8 = "fp8"
    MXFP4 = "fp4"

    # Equal to its value, so hashed like it: a member and its value find the same dict entry.
    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value

    @classmethod
    def _missing_(cls, value: object) -> "WeightFormat | None":
        if isinstance(value, str):
            spelled = value.strip().lower()
            for member in cls:
                if spelled in _SPELLINGS[member]:
                    return member
        return None

    @classmethod
    def parse(cls, value: Union["WeightFormat", str], what: str = "weights") -> "WeightFormat":
        """The member ``value`` names; a :class:`MegaMoEError` naming ``what`` and the spellings
        otherwise."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value)
            except ValueError:
                pass
        raise MegaMoEError(f"{what} must be one of {', '.join(cls.spellings())}, got {value!r}")

    @classmethod
    def spellings(cls) -> Tuple[str, ...]:
        """Every spelling :meth:`parse` reads, values first."""
        return tuple(s for m in cls for s in _SPELLINGS[m][:1]) + tuple(
            s for m in cls for s in _SPELLINGS[m][1:])

    @property
    def display(self) -> str:
        """The name people use for the format (``mxfp4``), for messages and docs."""
        return "mxfp4" if self is WeightFormat.MXFP4 else self.value


_SPELLINGS = {WeightFormat.FP8: ("fp8",), WeightFormat.MXFP4: ("fp4", "mxfp4")}

# The stored values, in declaration order (what sweep files and result rows may hold).
WEIGHT_FORMATS: Tuple[str, ...] = tuple(m.value for m in WeightFormat)
