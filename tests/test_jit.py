"""JIT: content-hashed nvcc builds, build locking, ptxas reports, tensor-map checks, driver launch.

CPU tiers need only ``nvcc`` (skipped without it); tests marked ``gpu`` load and launch cubins.
"""

import fcntl
import importlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fake_driver.harness import build_fake_driver, run_with_fake_driver
from megamoe_cli.errors import MegaMoEError, MegaMoETimeout
from megamoe_cli.kernel.jit import (
    BuildError,
    KernelSource,
    PtxasReport,
    build,
    cache_dir,
    encode_tensor_map_2d,
    load_module,
    validate_tensor_map_2d,
    variant_key,
)
from megamoe_cli.kernel.jit import driver

# The package's ``build`` is the function; the module it lives in is reached by its full name.
build_module = importlib.import_module("megamoe_cli.kernel.jit.build")

REPO = Path(__file__).resolve().parents[1]
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="needs nvcc on PATH")

SCALE_SOURCE = """
template <int kScale>
__device__ __forceinline__ float scaled(float v) { return v * kScale; }

extern "C" __global__ void __launch_bounds__(128) scale_kernel(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = scaled<%d>(x[i]);
}
"""

SPILL_SOURCE = """
extern "C" __global__ void spill(float* x, int n) {
    float a[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) a[i] = x[threadIdx.x * 64 + i];
    for (int j = 0; j < n; ++j) {
#pragma unroll
        for (int i = 0; i < 64; ++i) a[i] = a[i] * a[(i + 7) % 64] + a[(i + 13) % 64];
    }
#pragma unroll
    for (int i = 0; i < 64; ++i) x[threadIdx.x * 64 + i] = a[i];
}
"""


def scale_variant(scale, name=None, **kwargs):
    return KernelSource(name or f"scale{scale}", SCALE_SOURCE % scale, **kwargs)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    directory = tmp_path / "cache"
    monkeypatch.setenv(build_module.ENV_CACHE_DIR, str(directory))
    monkeypatch.delenv(build_module.ENV_NVCC, raising=False)
    return directory


def slow_nvcc(tmp_path, seconds, before_compile=""):
    """An nvcc that logs each compile to ``starts`` and sleeps first; ``--version`` matches the real one."""
    starts = tmp_path / "starts"
    wrapper = tmp_path / "slow-nvcc"
    wrapper.write_text(
        textwrap.dedent(
            f"""\
            #!/bin/sh
            if [ "$1" = "--version" ]; then exec {NVCC} --version; fi
            echo $$ >> {starts}
            sleep {seconds}
            {before_compile}
            exec {NVCC} "$@"
            """
        )
    )
    wrapper.chmod(0o755)
    return wrapper, starts


def compile_starts(starts):
    return len(starts.read_text().split()) if starts.exists() else 0


WORKER = """
import json, os, sys, time
from pathlib import Path
from megamoe_cli.kernel.jit import KernelSource, build
source, go = Path(sys.argv[1]), Path(sys.argv[2])
while not go.exists():
    time.sleep(0.01)
(kernel,) = build([KernelSource("raced", source.read_text())], lock_timeout_s=60)
print(json.dumps({"from_cache": kernel.from_cache, "cubin": str(kernel.cubin_path), "key": kernel.key}))
"""


def start_worker(tmp_path, cache, nvcc, go):
    source = tmp_path / "raced.cu"
    source.write_text(SCALE_SOURCE % 7)
    env = dict(os.environ, MEGAMOE_CACHE_DIR=str(cache), MEGAMOE_NVCC=str(nvcc), PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, str(source), str(go)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


# Builds and the cache


@needs_nvcc
def test_parallel_build_compiles_each_variant_once_through_ninja(cache, monkeypatch):
    ninja_batches = []
    real = build_module._compile_with_ninja

    def spy(ninja, variants, jobs, verbose):
        ninja_batches.append(sorted(v.kernel.name for v in variants))
        return real(ninja, variants, jobs, verbose)

    monkeypatch.setattr(build_module, "_compile_with_ninja", spy)
    kernels = build([scale_variant(2), scale_variant(3)], jobs=2)

    assert ninja_batches == [["scale2", "scale3"]]
    assert [k.name for k in kernels] == ["scale2", "scale3"]
    assert kernels[0].key != kernels[1].key
    for kernel in kernels:
        assert not kernel.from_cache
        assert kernel.cubin_path == cache / f"{kernel.name}-{kernel.key[:16]}" / "kernel.cubin"
        assert kernel.cubin_path.read_bytes()[:4] == b"\x7fELF"
        directory = kernel.cubin_path.parent
        assert (directory / "kernel.cu").read_text() == SCALE_SOURCE % int(kernel.name[-1])
        assert "Used" in (directory / "ptxas.txt").read_text()
        assert json.loads((directory / "report.json").read_text())["key"] == kernel.key
        assert sorted(p.name for p in directory.iterdir()) == [".lock", "kernel.cu", "kernel.cubin", "ptxas.txt", "report.json"]
        entry = kernel.report["scale_kernel"]
        assert entry.entry and entry.registers > 0
        assert not kernel.report.has_spills
    assert not [p for p in cache.iterdir() if p.name.startswith(".ninja-")]


@needs_nvcc
def test_without_ninja_variants_still_build(cache, monkeypatch):
    monkeypatch.setattr(build_module, "_find_ninja", lambda: None)
    kernels = build([scale_variant(4), scale_variant(5)], jobs=2)
    assert all(k.cubin_path.read_bytes()[:4] == b"\x7fELF" and not k.from_cache for k in kernels)


@needs_nvcc
def test_same_source_is_a_cache_hit(cache, monkeypatch):
    (first,) = build([scale_variant(2)])
    mtime = first.cubin_path.stat().st_mtime_ns

    def no_compile(*args, **kwargs):
        raise AssertionError("a cached variant was compiled again")

    monkeypatch.setattr(build_module, "_compile", no_compile)
    second, again = build([scale_variant(2), scale_variant(2)])
    assert second.from_cache and again.from_cache
    assert second.key == first.key and second.cubin_path == first.cubin_path
    assert second.cubin_path.stat().st_mtime_ns == mtime
    assert second.report == first.report


@needs_nvcc
def test_key_follows_headers_flags_and_source(cache, tmp_path):
    include = tmp_path / "csrc"
    (include / "megamoe").mkdir(parents=True)
    header = include / "megamoe" / "scale.cuh"
    header.write_text("#pragma once\nconstexpr int kScale = 2;\n")
    source = '#include <megamoe/scale.cuh>\nextern "C" __global__ void k(float* x) { x[threadIdx.x] *= kScale; }\n'
    variant = KernelSource("with_header", source, include_dirs=(str(include),))
    (first,) = build([variant])

    (include / "NOTES.md").write_text("not a header")
    assert variant_key(variant) == first.key

    header.write_text("#pragma once\nconstexpr int kScale = 3;\n")
    (second,) = build([variant])
    assert second.key != first.key and not second.from_cache
    assert second.cubin_path.parent != first.cubin_path.parent
    assert first.cubin_path.exists()

    (include / "megamoe" / "unused.cuh").write_text("#pragma once\n")
    assert variant_key(variant) != second.key
    assert variant_key(KernelSource("with_header", source, flags=("-DX=1",), include_dirs=(str(include),))) != variant_key(variant)
    assert variant_key(KernelSource("with_header", source + "\n", include_dirs=(str(include),))) != variant_key(variant)


@needs_nvcc
def test_header_edited_during_the_compile_is_not_cached(cache, tmp_path, monkeypatch):
    include = tmp_path / "csrc"
    include.mkdir()
    header = include / "scale.cuh"
    header.write_text("constexpr int kScale = 2;\n")
    nvcc, _ = slow_nvcc(tmp_path, 0, before_compile=f"echo 'constexpr int kScale = 3;' > {header}")
    monkeypatch.setenv(build_module.ENV_NVCC, str(nvcc))
    source = '#include "scale.cuh"\nextern "C" __global__ void k(float* x) { x[threadIdx.x] *= kScale; }\n'
    variant = KernelSource("edited", source, include_dirs=(str(include),))
    with pytest.raises(BuildError, match="changed while this variant compiled"):
        build([variant])
    assert not list(cache.glob("edited-*/kernel.cubin"))
    monkeypatch.delenv(build_module.ENV_NVCC)
    (kernel,) = build([variant])
    assert kernel.key == variant_key(variant) and kernel.cubin_path.exists()


@needs_nvcc
def test_compile_error_raises_with_command_and_log(cache):
    broken = KernelSource("broken", 'extern "C" __global__ void k(float* x) { x[0] = undefined_name; }\n')
    with pytest.raises(BuildError) as caught:
        build([scale_variant(2), broken], jobs=2)
    error = caught.value
    assert error.name == "broken"
    assert "nvcc" in error.command and "kernel.cu" in error.command
    assert "undefined_name" in error.log and "error" in error.log
    assert "broken" in str(error) and error.command in str(error) and "undefined_name" in str(error)

    directory = next(cache.glob("broken-*"))
    assert sorted(p.name for p in directory.iterdir()) == [".lock", "kernel.cu"]
    (good,) = build([scale_variant(2)])
    assert good.from_cache


@needs_nvcc
def test_forced_spill_is_reported(cache):
    # -maxrregcount applies to kernels without __launch_bounds__; ptxas raises 16 to its sm_90 floor of 24.
    (kernel,) = build([KernelSource("spill", SPILL_SOURCE, flags=("-maxrregcount=16",))])
    entry = kernel.report["spill"]
    assert kernel.report.has_spills and entry.has_spills
    assert entry.spill_stores_bytes > 0 and entry.spill_loads_bytes > 0 and entry.stack_frame_bytes > 0
    assert 0 < entry.registers <= 32
    assert "SPILLS" in kernel.report.summary()


# Concurrency and killed builds


@needs_nvcc
@pytest.mark.slow
def test_three_processes_racing_build_one_cubin(cache, tmp_path):
    nvcc, starts = slow_nvcc(tmp_path, 1)
    go = tmp_path / "go"
    workers = [start_worker(tmp_path, cache, nvcc, go) for _ in range(3)]
    go.touch()
    results = []
    for worker in workers:
        stdout, stderr = worker.communicate(timeout=120)
        assert worker.returncode == 0, stderr
        results.append(json.loads(stdout))

    assert compile_starts(starts) == 1
    assert sorted(r["from_cache"] for r in results) == [False, True, True]
    assert len({r["cubin"] for r in results}) == 1 and len({r["key"] for r in results}) == 1
    cubin = Path(results[0]["cubin"])
    assert cubin.read_bytes()[:4] == b"\x7fELF"
    assert sorted(p.name for p in cubin.parent.iterdir()) == [".lock", "kernel.cu", "kernel.cubin", "ptxas.txt", "report.json"]


@needs_nvcc
def test_killed_build_leaves_no_cubin_and_no_stale_lock(cache, tmp_path):
    nvcc, starts = slow_nvcc(tmp_path, 60)
    go = tmp_path / "go"
    go.touch()
    worker = start_worker(tmp_path, cache, nvcc, go)
    try:
        deadline = time.monotonic() + 30
        while compile_starts(starts) == 0:
            assert worker.poll() is None, worker.stderr.read()
            assert time.monotonic() < deadline, "the build never started"
            time.sleep(0.02)
        # Kill only the building Python process: its compiler child lives on, as after a crashed rank.
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()

        (directory,) = cache.glob("raced-*")
        assert not (directory / "kernel.cubin").exists()
        assert list(directory.glob("kernel.cubin.tmp-*"))

        started = time.monotonic()
        (kernel,) = build([KernelSource("raced", SCALE_SOURCE % 7)], lock_timeout_s=10)
        assert time.monotonic() - started < 10
        assert not kernel.from_cache
        assert kernel.cubin_path == directory / "kernel.cubin"
        assert kernel.cubin_path.read_bytes()[:4] == b"\x7fELF"
        assert not list(directory.glob("*.tmp-*"))
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.communicate()


@needs_nvcc
def test_lock_wait_times_out_with_a_clear_message(cache):
    variant = scale_variant(9)
    directory = cache / f"scale9-{variant_key(variant)[:16]}"
    directory.mkdir(parents=True)
    with open(directory / ".lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("4242\n")
        held.flush()
        started = time.monotonic()
        with pytest.raises(MegaMoETimeout, match=r"build lock .*'scale9'.*pid 4242"):
            build([variant], lock_timeout_s=0.3)
        assert time.monotonic() - started < 5
    (kernel,) = build([variant], lock_timeout_s=5)
    assert not kernel.from_cache


# Pure Python: no nvcc, no GPU


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(build_module.ENV_CACHE_DIR, str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "x"
    monkeypatch.delenv(build_module.ENV_CACHE_DIR)
    assert cache_dir() == Path.home() / ".cache" / "megamoe" / "jit"


def test_kernel_source_rejects_bad_input(tmp_path):
    with pytest.raises(MegaMoEError, match="name"):
        KernelSource("bad/name", "x")
    with pytest.raises(MegaMoEError, match="source"):
        KernelSource("ok", "  ")
    with pytest.raises(MegaMoEError, match="include dir"):
        KernelSource("ok", "x", include_dirs=(str(tmp_path / "missing"),))
    assert KernelSource("ok", "x", flags=["-DA=1"]).flags == ("-DA=1",)


def test_ptxas_report_parses_entries_device_functions_and_old_format():
    log = textwrap.dedent(
        """\
        ptxas info    : 0 bytes gmem
        ptxas info    : Function properties for _Z6helperv
            16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
        ptxas info    : Compiling entry function '_Z4mainILi64EEvPf' for 'sm_90a'
        ptxas info    : Function properties for _Z4mainILi64EEvPf
            0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
        ptxas info    : Used 168 registers, used 1 barriers, 1024 bytes smem
        ptxas info    : Compiling entry function 'old' for 'sm_90a'
        ptxas info    : Function properties for old
            0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
        ptxas info    : Used 10 registers, 256 bytes smem, 352 bytes cmem[0]
        """
    )
    report = PtxasReport.parse(log)
    main = report["_Z4mainILi64EEvPf"]
    assert (main.registers, main.barriers, main.smem_bytes, main.entry, main.has_spills) == (168, 1, 1024, True, False)
    assert (report["old"].registers, report["old"].smem_bytes) == (10, 256)
    helper = report["_Z6helperv"]
    assert not helper.entry and helper.spill_stores_bytes == 8 and helper.stack_frame_bytes == 16
    assert report.has_spills and sorted(report.entries) == ["_Z4mainILi64EEvPf", "old"]
    assert PtxasReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report


def test_build_error_keeps_only_the_log_tail():
    log = "\n".join(f"line {i}" for i in range(200))
    error = BuildError("v", "nvcc -cubin v.cu", log, ["w"])
    assert "line 199" in str(error) and "line 140" in str(error) and "line 139" not in str(error)
    assert "w" in str(error).splitlines()[-1] and error.log == log


GOOD_MAP = dict(dtype="fp8", address=0x7F0000001000, dims=(7168, 4096), outer_stride_bytes=7168, box=(128, 64), swizzle="128b")


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(dtype="fp16"), "dtype must be one of"),
        (dict(swizzle="256b"), "swizzle must be one of"),
        (dict(address=0x7F0000001008), "16-byte aligned"),
        (dict(address=0), "positive integer"),
        (dict(dims=(0, 4)), "inner dim"),
        (dict(dims=(64,)), "two integers"),
        (dict(outer_stride_bytes=7176), "multiple of 16"),
        (dict(outer_stride_bytes=4096), "rows would overlap"),
        (dict(box=(128, 512)), r"box outer dim must be in \[1, 256\]"),
        (dict(box=(8, 64)), "multiple of 16 B"),
        (dict(dtype="bf16", box=(128, 64), outer_stride_bytes=14336), "exceeds the 128b swizzle span of 128 B"),
        (dict(dtype="f32", box=(32, 64), swizzle="64b", outer_stride_bytes=28672), "at most 16 f32 elements"),
        (dict(box=(64, 64), swizzle="32b"), "32b swizzle span"),
    ],
)
def test_tensor_map_validation_names_the_rule(change, message):
    arguments = dict(GOOD_MAP, **change)
    with pytest.raises(MegaMoEError, match=message) as caught:
        encode_tensor_map_2d(**arguments, name="w1")
    assert "'w1'" in str(caught.value)


def test_tensor_map_valid_layouts_pass_validation():
    validate_tensor_map_2d(**GOOD_MAP)
    validate_tensor_map_2d("bf16", 0x1000, (7168, 10), 14336, (64, 256), "128b")
    validate_tensor_map_2d("f32", 0x1000, (56, 4096), 224, (4, 128), "none")
    validate_tensor_map_2d("i32", 0x1000, (3, 1), 16, (4, 1), "none")


@pytest.fixture(scope="module")
def fake_driver_run(tmp_path_factory):
    """Module loading, globals, attributes and tensor maps through cuda.bindings, against a
    stand-in ``libcuda.so.1`` that records what it is given (tests/fake_driver)."""
    library = build_fake_driver(tmp_path_factory.mktemp("fake_driver"))
    (library / "k.cubin").write_bytes(b"\x7fELF" + bytes(range(12)))
    (library / "report.json").write_text(json.dumps({"report": PtxasReport.parse(
        "ptxas info    : Compiling entry function 'k' for 'sm_90a'\n").to_dict()}))
    return run_with_fake_driver(library, r"""
from megamoe_cli.kernel.jit import driver, encode_tensor_map_2d, load_module
out = {}
module = load_module("k.cubin", 1)
out["context"] = module.context
out["image"] = bytes((ctypes.c_ubyte * 16).from_address(fake.fake_module_image())).hex()
out["cached"] = load_module("k.cubin", 1) is module
function = module.get_function("k")
out["registers"] = function.num_registers
function.set_max_dynamic_smem(150_000)
attr = (ctypes.c_int * 2).from_address(fake.fake_func_attribute_set())
out["attribute_set"] = list(attr)
out["blocks"] = [function.max_active_blocks_per_sm(384, 100_000), function.max_active_blocks_per_sm(384, 220_000)]
out["clusters"] = function.max_active_clusters(384, 100_000, 2)
out["occupancy_cluster"] = fake.fake_occupancy_cluster()

counters = (ctypes.c_ubyte * 48).from_address(fake.fake_global_counters())
counters[:] = list(range(48))
out["global"] = module.read_global("megamoe_profile").hex()
module.zero_global("megamoe_profile")
out["zeroed"] = bytes(counters).hex()

tensor_map = encode_tensor_map_2d("bf16", 0x7F0000001000, (7168, 4096), 14336, (64, 32), "128b", name="y")
out["map_bytes"] = len(tensor_map)
out["map_args"] = list(struct.unpack("<14Q", tensor_map[:112]))
out["map_f32"] = list(struct.unpack("<14Q", encode_tensor_map_2d("f32", 0x1000, (56, 4096), 224, (4, 128), "none")[:112]))

handle, offset = driver.ipc_export(0x7F0000012345, 0)
out["ipc"] = [handle.hex(), offset, driver.ipc_open(handle, 16, 0)]
driver.ipc_close(handle, 0)
out["pci"] = [driver.pci_bus_id(1), driver.device_by_pci_bus_id("0000:19:00.0"),
              driver.device_by_pci_bus_id("0000:55:00.0"), driver.peer_native_atomics(0, 1),
              driver.peer_native_atomics(1, 1)]

try:
    module.get_function("missing_kernel")
except driver.CudaDriverError as error:
    out["missing"] = str(error)
print(json.dumps(out))
""")


def test_modules_load_through_the_binding(fake_driver_run):
    assert fake_driver_run["context"] == 0xC001, "loaded into device 1's primary context"
    assert bytes.fromhex(fake_driver_run["image"]) == b"\x7fELF" + bytes(range(12)), "the cubin's bytes reach the driver"
    assert fake_driver_run["cached"]
    assert fake_driver_run["registers"] == 168
    assert fake_driver_run["attribute_set"] == [8, 150_000]  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    assert fake_driver_run["blocks"] == [1, 0]
    assert fake_driver_run["occupancy_cluster"] == 2 and fake_driver_run["clusters"] == 66


def test_module_globals_are_read_and_zeroed(fake_driver_run):
    assert bytes.fromhex(fake_driver_run["global"]) == bytes(range(48))
    assert bytes.fromhex(fake_driver_run["zeroed"]) == bytes(48)


def test_tensor_maps_pass_the_cuda_h_enum_values(fake_driver_run):
    # dtype, rank, address, dims, outer stride, box, element strides, interleave, swizzle, L2 promotion, OOB fill;
    # the enum values as cuda.h numbers them (BFLOAT16 9, FLOAT32 7, SWIZZLE_128B 3, L2_256B 3)
    assert fake_driver_run["map_bytes"] == 128
    assert fake_driver_run["map_args"] == [9, 2, 0x7F0000001000, 7168, 4096, 14336, 64, 32, 1, 1, 0, 3, 3, 0]
    assert fake_driver_run["map_f32"] == [7, 2, 0x1000, 56, 4096, 224, 4, 128, 1, 1, 0, 0, 3, 0]


def test_ipc_handles_and_devices_through_the_binding(fake_driver_run):
    handle_hex, offset, mapped = fake_driver_run["ipc"]
    handle = bytes.fromhex(handle_hex)
    # The stand-in fills the handle from the allocation's base (address & ~0xFFFF) with zeros between.
    assert len(handle) == 64 and handle[0] == 0x01 and handle[1:3] == b"\0\0" and offset == 0x2345
    # Its open maps at 0x70000 + first byte + last byte: all 64 bytes went through, by value.
    assert mapped == 0x70000 + handle[0] + handle[63] + 16
    assert fake_driver_run["pci"] == ["0000:19:00.0", 1, None, True, False]


def test_an_unknown_function_is_named_with_the_modules_entries(fake_driver_run):
    message = fake_driver_run["missing"]
    assert "'missing_kernel'" in message and "CUDA_ERROR_NOT_FOUND" in message and "['k']" in message


def test_without_a_driver_calls_fail_clearly(tmp_path):
    if driver.is_available():
        pytest.skip("a CUDA driver is present")
    with pytest.raises(RuntimeError, match="libcuda.so.1"):
        load_module(tmp_path / "kernel.cubin")
    with pytest.raises(RuntimeError, match="libcuda.so.1"):
        encode_tensor_map_2d(**GOOD_MAP)


# GPU: load, launch, clusters, TMA


GPU_SOURCE = r"""
#include <cstdint>

struct alignas(64) TensorMap { unsigned long long opaque[16]; };

struct TmaParams {
    TensorMap map;
    float* out;
    int coord_inner;
    int coord_outer;
};

template <int kBoxInner, int kBoxOuter>
__device__ void tma_copy_tile(const TmaParams& p) {
    __shared__ alignas(1024) float tile[kBoxOuter * kBoxInner];
    __shared__ alignas(8) uint64_t bar;
    const uint32_t bar_addr = static_cast<uint32_t>(__cvta_generic_to_shared(&bar));
    const uint32_t tile_addr = static_cast<uint32_t>(__cvta_generic_to_shared(tile));
    // Init barrier
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar_addr));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    // Issue TMA load
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                     :: "r"(bar_addr), "r"(static_cast<uint32_t>(sizeof(tile))) : "memory");
        asm volatile(
            "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
            :: "r"(tile_addr), "l"(reinterpret_cast<uint64_t>(&p.map)), "r"(p.coord_inner), "r"(p.coord_outer),
               "r"(bar_addr)
            : "memory");
    }
    // Wait for the bytes
    uint32_t done = 0;
    while (!done) {
        asm volatile("{\n .reg .pred P;\n mbarrier.try_wait.parity.shared::cta.b64 P, [%1], 0;\n selp.u32 %0, 1, 0, P;\n}"
                     : "=r"(done) : "r"(bar_addr) : "memory");
    }
    for (int i = threadIdx.x; i < kBoxOuter * kBoxInner; i += blockDim.x) p.out[i] = tile[i];
}

extern "C" __global__ void __launch_bounds__(128) tma_copy(const __grid_constant__ TmaParams p) {
    tma_copy_tile<32, 8>(p);
}

struct ClusterParams { int* out; };

extern "C" __global__ void cluster_info(const __grid_constant__ ClusterParams p) {
    uint32_t rank, size;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(size));
    if (threadIdx.x == 0) {
        p.out[blockIdx.x * 2] = static_cast<int>(rank);
        p.out[blockIdx.x * 2 + 1] = static_cast<int>(size);
    }
}

struct SmemParams { float* out; int n; };

extern "C" __global__ void dynamic_smem_sum(const __grid_constant__ SmemParams p) {
    extern __shared__ float buffer[];
    for (int i = threadIdx.x; i < p.n; i += blockDim.x) buffer[i] = static_cast<float>(i & 7);
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.f;
        for (int i = 0; i < p.n; ++i) total += buffer[i];
        p.out[0] = total;
    }
}
"""


@pytest.fixture
def gpu_module(cache):
    (kernel,) = build([KernelSource("gpu_tests", GPU_SOURCE)])
    return load_module(kernel.cubin_path)


@needs_nvcc
@pytest.mark.gpu
@pytest.mark.parametrize("swizzle", ["none", "128b"])
def test_tma_tile_load_through_an_encoded_tensor_map(gpu_module, swizzle):
    import torch

    rows, cols, padded_cols = 64, 48, 64
    storage = torch.arange(rows * padded_cols, dtype=torch.float32, device="cuda").reshape(rows, padded_cols)
    out = torch.full((8 * 32,), -1.0, device="cuda")
    tensor_map = encode_tensor_map_2d(
        "f32", storage.data_ptr(), (cols, rows), padded_cols * 4, (32, 8), swizzle, name="storage"
    )
    assert len(tensor_map) == 128
    coord_inner, coord_outer = 32, 8
    params = tensor_map + struct.pack("<Qii48x", out.data_ptr(), coord_inner, coord_outer)
    function = gpu_module.get_function("tma_copy")
    assert function.params_bytes() == len(params) == 192
    function.launch((1,), (128,), 0, torch.cuda.current_stream().cuda_stream, params)
    torch.cuda.synchronize()

    expected = torch.zeros(8, 32, device="cuda")
    in_bounds = cols - coord_inner
    expected[:, :in_bounds] = storage[coord_outer : coord_outer + 8, coord_inner:cols]
    if swizzle == "128b":
        # 16-byte chunk c of row r lands at chunk c ^ (r % 8)
        swizzled = torch.empty_like(expected)
        for r in range(8):
            for c in range(8):
                swizzled[r, (c ^ (r % 8)) * 4 : (c ^ (r % 8)) * 4 + 4] = expected[r, c * 4 : c * 4 + 4]
        expected = swizzled
    assert torch.equal(out.reshape(8, 32), expected)


@needs_nvcc
@pytest.mark.gpu
def test_cluster_launch_sets_cluster_rank_and_size(gpu_module):
    import torch

    function = gpu_module.get_function("cluster_info")
    stream = torch.cuda.current_stream().cuda_stream
    for cluster, ranks, sizes in [((2, 1, 1), [0, 1, 0, 1], [2] * 4), ((1, 1, 1), [0] * 4, [1] * 4)]:
        out = torch.full((8,), -1, dtype=torch.int32, device="cuda")
        function.launch((4,), (32,), 0, stream, struct.pack("<Q", out.data_ptr()), cluster=cluster)
        torch.cuda.synchronize()
        assert out.reshape(4, 2).tolist() == [[r, s] for r, s in zip(ranks, sizes)]
    with pytest.raises(ValueError, match="not a multiple of cluster"):
        function.launch((3,), (32,), 0, stream, struct.pack("<Q", out.data_ptr()), cluster=(2, 1, 1))


@needs_nvcc
@pytest.mark.gpu
def test_dynamic_smem_needs_the_attribute_and_params_must_fit(gpu_module):
    import torch

    function = gpu_module.get_function("dynamic_smem_sum")
    assert function.num_registers > 0
    out = torch.zeros(1, device="cuda")
    n = 100 * 1024 // 4
    params = struct.pack("<Qi4x", out.data_ptr(), n)
    stream = torch.cuda.current_stream().cuda_stream
    with pytest.raises(driver.CudaDriverError, match="CUDA_ERROR_INVALID_VALUE"):
        function.launch((1,), (256,), n * 4, stream, params)
    function.set_max_dynamic_smem(n * 4)
    assert function.max_active_blocks_per_sm(256, n * 4) >= 1
    function.launch((1,), (256,), n * 4, stream, params)
    torch.cuda.synchronize()
    assert out.item() == float(sum(i & 7 for i in range(n)))
    with pytest.raises(ValueError, match="16-byte parameter block, got 12 bytes"):
        function.launch((1,), (256,), n * 4, stream, params[:12])


@needs_nvcc
@pytest.mark.gpu
def test_modules_are_cached_and_unknown_functions_named(gpu_module):
    assert load_module(gpu_module.path) is gpu_module
    assert gpu_module.get_function("tma_copy") is gpu_module.get_function("tma_copy")
    with pytest.raises(driver.CudaDriverError, match="CUDA_ERROR_NOT_FOUND") as caught:
        gpu_module.get_function("missing_kernel")
    assert "missing_kernel" in str(caught.value) and "'cluster_info'" in str(caught.value)


def test_a_variant_whose_wgmmas_ptxas_serialized_is_refused_before_loading(monkeypatch):
    """ptxas serializes WGMMAs when it runs short of registers (C7511): the kernel stays correct but
    runs several times slower, so the runtime refuses such a release build as it refuses spills,
    naming the note; a profiling build (extra counters) is still loaded."""
    from types import SimpleNamespace

    from megamoe_cli.errors import MegaMoEError
    from megamoe_cli.fused import launch
    from megamoe_cli.kernel import jit
    from megamoe_cli.kernel.jit.build import PtxasReport
    from megamoe_cli.kernel.kernel_source import Variant
    from megamoe_cli.layout import PRESETS

    note = ("ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are serialized due "
            "to insufficient register resources for the wgmma pipeline in the function 'megamoe_kernel'")
    report = PtxasReport.parse(note + "\nptxas info    : Compiling entry function 'megamoe_kernel' for 'sm_90a'\n"
                               "ptxas info    : Used 168 registers, used 6 barriers\n")
    assert "WGMMAs SERIALIZED" in report.summary()
    loaded = []
    monkeypatch.setattr(jit, "build", lambda sources: [SimpleNamespace(report=report, cubin_path="x.cubin")])
    monkeypatch.setattr(jit, "load_module", lambda *args: loaded.append(args))
    variant = Variant(PRESETS["deepseek-v3"], 2, 128, 64, 4)
    monkeypatch.setattr(launch, "profiling_enabled", lambda: False)
    with pytest.raises(MegaMoEError, match=r"ptxas serialized its WGMMAs \(ptxas info .*C7511.*\); expected none"):
        launch.Kernel(variant, SimpleNamespace(index=0))
    assert loaded == []
