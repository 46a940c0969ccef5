"""Where a result was measured: GPU, driver, software versions, source revision.

Collected once per run by rank 0 of the worker (the process that owns a GPU),
so the launcher never creates a CUDA context of its own.  Every probe is
bounded in time and degrades to an empty value rather than failing the run.

Imports: none of ``megamoe_cli.bench``.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, Optional

ENV_COLUMNS = (
    "gpu",
    "gpu_count",
    "driver",
    "torch",
    "cuda",
    "python",
    "git_commit",
    "git_dirty",
    "hostname",
)

_PROBE_TIMEOUT_S = 10.0

# The checkout this package runs from (the package is run from the source tree).
SOURCE_ROOT = Path(__file__).resolve().parents[2]


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _run(args, cwd: Optional[Path] = None) -> Optional[str]:
    try:
        done = subprocess.run(
            args, cwd=cwd, capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


ENV_GIT_COMMIT = "MEGAMOE_GIT_COMMIT"


def git_info(root: Path = SOURCE_ROOT) -> Dict[str, Any]:
    """The checkout's commit.  ``$MEGAMOE_GIT_COMMIT``, where set, wins (with unknown
    dirtiness): a tree copied to a GPU host has no git history of its own, or a stale one."""
    override = os.environ.get(ENV_GIT_COMMIT, "")
    if override:
        return {"git_commit": override, "git_dirty": None}
    commit = _run(["git", "rev-parse", "HEAD"], cwd=root)
    if commit is None:
        return {"git_commit": "", "git_dirty": None}
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root)
    return {"git_commit": commit, "git_dirty": bool(status) if status is not None else None}


def driver_version() -> str:
    try:
        import pynvml  # nvidia-ml-py, optional

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:
        pass
    out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out else ""


def collect(device: str) -> Dict[str, Any]:
    """Environment columns for rows measured on ``device`` ("cuda" or "cpu")."""
    import torch

    info = host_info()
    info.update(torch=torch.__version__, cuda=torch.version.cuda or "")
    if device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.cuda.current_device())
        info["gpu_count"] = torch.cuda.device_count()
        info["driver"] = driver_version()
    elif device == "cpu":
        info["gpu"] = "cpu"
    return info


def host_info() -> Dict[str, Any]:
    """The columns that need neither torch nor a GPU (GPU columns left empty)."""
    info: Dict[str, Any] = {
        "gpu": "",
        "gpu_count": 0,
        "driver": "",
        "torch": "",
        "cuda": "",
        "python": platform.python_version(),
        "hostname": socket.gethostname(),
    }
    info.update(git_info())
    return info
