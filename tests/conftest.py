"""Test tiers: CPU tests run everywhere; tests marked ``gpu`` are skipped where CUDA is unavailable.

Tests leave nothing behind: for the session, the temporary folder (``TMPDIR``, which the bench
run folders, the A/B logs and every subprocess use) is a private one, and the JIT kernel cache is
one too unless ``MEGAMOE_CACHE_DIR`` names one (a GPU run may point it at a warm cache); both go at
the end.  A test that leaves files in that temporary folder fails, naming them."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest

CACHE_ENV = "MEGAMOE_CACHE_DIR"


@pytest.fixture(scope="session", autouse=True)
def private_temp_folder(tmp_path_factory):
    tmp_path_factory.getbasetemp()  # pytest's own tmp_path folders stay where pytest keeps them
    root = Path(tempfile.mkdtemp(prefix="megamoe-tests-"))
    folder = root / "tmp"
    folder.mkdir()
    saved = {name: os.environ.get(name) for name in ("TMPDIR", CACHE_ENV)}
    saved_tempdir = tempfile.tempdir
    os.environ["TMPDIR"] = str(folder)
    tempfile.tempdir = str(folder)
    if not os.environ.get(CACHE_ENV):
        os.environ[CACHE_ENV] = str(root / "jit-cache")
    # torch.compile's caches (Inductor, Triton) would otherwise land in TMPDIR, where they outlive
    # the test that compiled; they go with the session's folder instead.
    saved.update({name: os.environ.get(name) for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")})
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor-cache"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton-cache"))
    try:
        yield folder
    finally:
        tempfile.tempdir = saved_tempdir
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(autouse=True)
def leaves_nothing_behind(private_temp_folder):
    before = set(os.listdir(private_temp_folder))
    yield
    left = sorted(set(os.listdir(private_temp_folder)) - before)
    for name in left:
        path = private_temp_folder / name
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    if left:
        pytest.fail(f"the test left {', '.join(left)} in the temporary folder (run folders, logs): a test "
                    "writes under tmp_path, or removes what it made")


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in gpu_items:
        item.add_marker(skip)
