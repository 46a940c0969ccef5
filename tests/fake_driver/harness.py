"""Run Python against the stand-in driver (``libcuda.c`` beside this file) in a child process.

The child finds the stand-in as ``libcuda.so.1`` first on ``LD_LIBRARY_PATH``, so cuda.bindings
resolves every driver entry point to it; the test process itself never loads it (a GPU
machine's real driver stays in charge there).  Needs a C compiler; tests skip without one.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SOURCE = Path(__file__).with_name("libcuda.c")
REPO = Path(__file__).resolve().parents[2]

# Read the stand-in's records from the child (the same library the binding opened).
PRELUDE = """
import ctypes, json, struct
fake = ctypes.CDLL("libcuda.so.1")


class Launch(ctypes.Structure):
    _fields_ = [("function", ctypes.c_uint64), ("grid", ctypes.c_uint64 * 3), ("block", ctypes.c_uint64 * 3),
                ("smem", ctypes.c_uint64), ("stream", ctypes.c_uint64), ("cluster", ctypes.c_uint64 * 3),
                ("attribute_id", ctypes.c_uint64), ("params_address", ctypes.c_uint64),
                ("params", ctypes.c_ubyte * 64)]


fake.fake_last_launch.restype = ctypes.POINTER(Launch)
for _name in ("fake_module_image", "fake_global_counters", "fake_func_attribute_set"):
    getattr(fake, _name).restype = ctypes.c_void_p
fake.fake_occupancy_cluster.restype = ctypes.c_uint
fake.fake_set_current_context.argtypes = [ctypes.c_uint64]


def last_launch():
    l = fake.fake_last_launch().contents
    return dict(function=l.function, grid=list(l.grid), block=list(l.block), smem=l.smem, stream=l.stream,
                cluster=list(l.cluster), attribute_id=l.attribute_id, params_address=l.params_address,
                params=bytes(l.params).hex())
"""


def build_fake_driver(directory: Path) -> Path:
    """Compile the stand-in into ``directory/libcuda.so.1``; returns the directory."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("needs a C compiler to build the stand-in driver")
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(directory / "libcuda.so.1"), str(SOURCE), "-ldl"],
                   check=True, capture_output=True, text=True)
    return directory


def run_with_fake_driver(library_dir: Path, script: str) -> dict:
    """Run ``PRELUDE + script`` with the stand-in driver; the script prints one JSON object last."""
    env = dict(os.environ, LD_LIBRARY_PATH=f"{library_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}",
               PYTHONPATH=f"{REPO}:{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run([sys.executable, "-c", PRELUDE + script], env=env, capture_output=True, text=True,
                          timeout=120, cwd=library_dir)
    assert done.returncode == 0, f"child exited with {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])
