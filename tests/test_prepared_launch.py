"""`PreparedLaunch` on the CPU: what a launch hands the driver, with the driver's entry points
replaced by recorders (the GPU tier launches real kernels through the same object)."""

import ctypes
import struct

import pytest

from megamoe_cli.jit import driver


class FakeModule:
    def __init__(self):
        self.made_current = 0

    def make_current(self):
        self.made_current += 1


def fake_function(params_bytes):
    module = FakeModule()
    function = driver.CudaFunction(module, "k", 0x1234)
    function._params_bytes, function._params_checked = params_bytes, True
    return function


@pytest.fixture
def calls(monkeypatch):
    """Every driver launch as (entry point, what it was given), the parameter block read back."""
    seen = []

    def launch_kernel(handle, gx, gy, gz, bx, by, bz, smem, stream, kernel_params, extra):
        block = ctypes.cast(kernel_params, ctypes.POINTER(ctypes.c_void_p))[0]
        seen.append(("cuLaunchKernel", dict(handle=handle.value, grid=(gx, gy, gz), block=(bx, by, bz), smem=smem,
                                            stream=stream, address=block, params=ctypes.string_at(block, 24))))
        return driver.CUDA_SUCCESS

    def launch_kernel_ex(config_ref, handle, kernel_params, extra):
        config = ctypes.cast(config_ref, ctypes.POINTER(driver.CUlaunchConfig)).contents
        block = ctypes.cast(kernel_params, ctypes.POINTER(ctypes.c_void_p))[0]
        dim = config.attrs[0].value.clusterDim
        seen.append(("cuLaunchKernelEx", dict(grid=(config.gridDimX, config.gridDimY, config.gridDimZ),
                                              stream=config.hStream, cluster=(dim.x, dim.y, dim.z),
                                              attr=config.attrs[0].id, params=ctypes.string_at(block, 24))))
        return driver.CUDA_SUCCESS

    fakes = {"cuLaunchKernel": launch_kernel, "cuLaunchKernelEx": launch_kernel_ex}
    monkeypatch.setattr(driver, "_function", lambda name: fakes[name])
    return seen


def test_the_driver_reads_the_block_as_written_at_each_launch(calls):
    function = fake_function(24)
    prepared = function.prepare((132,), (384,), 200_000, 24)
    prepared.params[:] = struct.pack("<QQQ", 1, 2, 3)
    prepared.launch(77)
    struct.pack_into("<Q", prepared.params, 8, 99)  # rewritten between launches, like y and num_tokens
    prepared.launch(78)
    (name0, first), (name1, second) = calls
    assert name0 == name1 == "cuLaunchKernel"
    assert first["grid"] == (132, 1, 1) and first["block"] == (384, 1, 1) and first["smem"] == 200_000
    assert first["handle"] == 0x1234 and (first["stream"], second["stream"]) == (77, 78)
    assert first["address"] % driver.PARAMS_ALIGN_BYTES == 0, "CUtensorMaps in the block need 64-byte alignment"
    assert struct.unpack("<QQQ", first["params"]) == (1, 2, 3)
    assert struct.unpack("<QQQ", second["params"]) == (1, 99, 3)
    assert function.module.made_current == 2


def test_a_cluster_launch_carries_the_cluster_and_the_stream(calls):
    prepared = fake_function(24).prepare((8,), (128,), 0, 24, cluster=(2, 1, 1))
    prepared.params[:] = bytes(range(24))
    prepared.launch(5)
    prepared.launch(6)
    assert [c[0] for c in calls] == ["cuLaunchKernelEx"] * 2
    assert calls[0][1]["cluster"] == (2, 1, 1) and calls[0][1]["grid"] == (8, 1, 1)
    assert calls[0][1]["attr"] == driver.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    assert (calls[0][1]["stream"], calls[1][1]["stream"]) == (5, 6)
    assert calls[1][1]["params"] == bytes(range(24))


def test_launch_copies_a_one_off_block_through_a_prepared_launch(calls):
    fake_function(24).launch((4,), (32,), 0, 9, struct.pack("<QQQ", 7, 8, 9))
    assert struct.unpack("<QQQ", calls[0][1]["params"]) == (7, 8, 9)


@pytest.mark.parametrize("kwargs,message", [
    (dict(grid=(3,), cluster=(2, 1, 1), nbytes=24), r"grid \(3, 1, 1\) is not a multiple of cluster \(2, 1, 1\)"),
    (dict(grid=(4,), cluster=(1, 1, 1), nbytes=16), "takes a 24-byte parameter block, got 16 bytes"),
    (dict(grid=(0,), cluster=(1, 1, 1), nbytes=24), r"grid must be 1 to 3 positive integers, got \(0,\)"),
])
def test_a_wrong_shape_is_refused_before_anything_is_launched(calls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        fake_function(24).prepare(kwargs["grid"], (32,), 0, kwargs["nbytes"], cluster=kwargs["cluster"])
    assert calls == []


def test_a_driver_error_names_the_launch(monkeypatch):
    monkeypatch.setattr(driver, "_function", lambda name: (lambda *args: 1))  # CUDA_ERROR_INVALID_VALUE
    monkeypatch.setattr(driver, "_error_text", lambda code: ("CUDA_ERROR_INVALID_VALUE", "invalid argument"))
    prepared = fake_function(24).prepare((4,), (32,), 1 << 20, 24)
    with pytest.raises(driver.CudaDriverError, match=r"cuLaunchKernel\(k, grid=\(4, 1, 1\).*smem=1048576"):
        prepared.launch(0)
