"""`PreparedLaunch` on the CPU: what a launch hands the driver through cuda.bindings, read back
from a stand-in ``libcuda.so.1`` that records its calls (tests/fake_driver); the GPU tier launches
real kernels through the same object."""

import struct

import pytest

from fake_driver.harness import build_fake_driver, run_with_fake_driver
from megamoe_cli.kernel.jit import driver


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """One child process runs every launch scenario against the stand-in driver."""
    library = build_fake_driver(tmp_path_factory.mktemp("fake_driver"))
    (library / "k.cubin").write_bytes(b"\x7fELF" + bytes(range(12)))
    return run_with_fake_driver(library, r"""
from megamoe_cli.kernel.jit import driver, load_module
out = {}
module = load_module("k.cubin", 0)
function = module.get_function("k")
out["params_bytes"] = function.params_bytes()

prepared = function.prepare((132,), (384,), 200_000, 24)
prepared.params[:] = struct.pack("<QQQ", 1, 2, 3)
prepared.launch(77)
out["first"] = last_launch()
struct.pack_into("<Q", prepared.params, 8, 99)  # rewritten between launches, like y and num_tokens
prepared.launch(78)
out["second"] = last_launch()

clustered = function.prepare((8,), (128,), 0, 24, cluster=(2, 1, 1))
clustered.params[:] = bytes(range(24))
clustered.launch(5)
out["cluster_first"] = last_launch()
clustered.launch(6)
out["cluster_second"] = last_launch()

function.launch((4,), (32,), 0, 9, struct.pack("<QQQ", 7, 8, 9))
out["one_off"] = last_launch()

# Another thread's work made another context current: the launch makes the module's current again.
sets_before = fake.fake_context_sets()
fake.fake_set_current_context(0xC001)
prepared.launch(11)
out["context_sets"] = fake.fake_context_sets() - sets_before
launches_before = fake.fake_launches()
prepared.launch(12)
out["context_sets_after"] = fake.fake_context_sets() - sets_before
out["driver_launches"] = fake.fake_launches() - launches_before

fake.fake_fail_next_launch(1)
try:
    prepared.launch(0)
except driver.CudaDriverError as error:
    out["error"] = str(error)
    out["error_name"] = error.error_name
print(json.dumps(out))
""")


def test_the_driver_reads_the_block_as_written_at_each_launch(launches):
    first, second = launches["first"], launches["second"]
    assert first["grid"] == [132, 1, 1] and first["block"] == [384, 1, 1] and first["smem"] == 200_000
    assert first["function"] == 0x6000 and (first["stream"], second["stream"]) == (77, 78)
    assert first["params_address"] % driver.PARAMS_ALIGN_BYTES == 0, "CUtensorMaps in the block need 64-byte alignment"
    assert first["params_address"] == second["params_address"], "the block is written in place, not copied per call"
    assert struct.unpack("<QQQ", bytes.fromhex(first["params"])[:24]) == (1, 2, 3)
    assert struct.unpack("<QQQ", bytes.fromhex(second["params"])[:24]) == (1, 99, 3)
    assert first["cluster"] == [0, 0, 0], "a launch without a cluster goes through cuLaunchKernel"
    assert launches["params_bytes"] == 24


def test_a_cluster_launch_carries_the_cluster_and_the_stream(launches):
    first, second = launches["cluster_first"], launches["cluster_second"]
    assert first["cluster"] == [2, 1, 1] and first["grid"] == [8, 1, 1] and first["block"] == [128, 1, 1]
    assert first["attribute_id"] == int(driver.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)
    assert (first["stream"], second["stream"]) == (5, 6)
    assert bytes.fromhex(second["params"])[:24] == bytes(range(24))


def test_launch_copies_a_one_off_block_through_a_prepared_launch(launches):
    assert struct.unpack("<QQQ", bytes.fromhex(launches["one_off"]["params"])[:24]) == (7, 8, 9)
    assert launches["one_off"]["stream"] == 9


def test_a_launch_restores_the_modules_context_and_makes_one_launch_call(launches):
    assert launches["context_sets"] == 1, "another context was current: the module's is made current once"
    assert launches["context_sets_after"] == 1, "already current: no second switch"
    assert launches["driver_launches"] == 1


def test_a_driver_error_names_the_launch(launches):
    assert launches["error_name"] == "CUDA_ERROR_INVALID_VALUE"
    assert "cuLaunchKernel(k, grid=(132, 1, 1), block=(384, 1, 1), smem=200000" in launches["error"]
    assert launches["error"].endswith("(invalid argument)")


class FakeModule:
    def make_current(self):
        raise AssertionError("a refused shape must not reach the driver")


def fake_function(params_bytes):
    function = driver.CudaFunction(FakeModule(), "k", 0x1234)
    function._params_bytes, function._params_checked = params_bytes, True
    return function


@pytest.mark.parametrize("kwargs,message", [
    (dict(grid=(3,), cluster=(2, 1, 1), nbytes=24), r"grid \(3, 1, 1\) is not a multiple of cluster \(2, 1, 1\)"),
    (dict(grid=(4,), cluster=(1, 1, 1), nbytes=16), "takes a 24-byte parameter block, got 16 bytes"),
    (dict(grid=(0,), cluster=(1, 1, 1), nbytes=24), r"grid must be 1 to 3 positive integers, got \(0,\)"),
])
def test_a_wrong_shape_is_refused_before_anything_is_launched(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fake_function(24).prepare(kwargs["grid"], (32,), 0, kwargs["nbytes"], cluster=kwargs["cluster"])
