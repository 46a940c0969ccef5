"""The eager `mega_moe` call on the host, on a CPU stand-in buffer with the launch recorded: what
each call writes into the plan's parameter block, when a plan is built or reused, and that the
checks protecting users still refuse bad input (the device side runs in tests/gpu)."""

import gc
import struct
import weakref

import pytest
import torch

from megamoe_cli import fused
from megamoe_cli.errors import MegaMoEError
from megamoe_cli.fused import launch
from megamoe_cli.kernel.kernel_source import KernelConfig
from megamoe_cli.layout import BufferConfig, build_layout, preset

SHAPE = preset("small")
T = 4
Y_OFFSET, NUM_TOKENS_OFFSET, INPUTS_OFFSET = 0, 8, 64


class Prepared:
    def __init__(self):
        self.params = memoryview(bytearray(128))
        self.streams = []

    def launch(self, stream):
        self.streams.append(stream)


class Kernel:
    smem_bytes = 0

    class function:
        @staticmethod
        def prepare(grid, block, smem, nbytes, cluster):
            return Prepared()


def cpu_buffer():
    buf = object.__new__(fused.SymmBuffer)
    buf.group, buf.rank, buf.world_size = None, 0, 1
    buf.config = BufferConfig(1, T, SHAPE, 64)
    buf.layout = build_layout(buf.config)
    buf.device = torch.device("cpu")
    buf.buffer = torch.zeros(buf.layout.total_bytes, dtype=torch.uint8)
    buf.handle, buf.shares_gpus, buf._ipc_opened, buf.closed = None, False, [], False
    buf.plans = {}
    buf.inputs = tuple(buf.view(name) for name in fused.INPUT_NAMES)
    buf.x, buf.x_sf, buf.topk_idx, buf.topk_weights = buf.inputs
    buf.input_ptrs = tuple(v.data_ptr() for v in buf.inputs)
    buf.span = (buf.buffer.data_ptr(), buf.buffer.data_ptr() + buf.nbytes)
    return buf


def weights():
    e, h, i = SHAPE.num_experts, SHAPE.hidden, SHAPE.intermediate
    fp8 = torch.float8_e4m3fn
    return (fused.ExpertWeights(torch.zeros(e, 2 * i // 256, h // 128, 256, 128, dtype=fp8),
                                torch.zeros(e, 2 * i // 128, h // 128, 2)),
            fused.ExpertWeights(torch.zeros(e, h // 256, i // 128, 256, 128, dtype=fp8),
                                torch.zeros(e, h // 128, i // 128)))


def aligned(shape, dtype):
    """A zeroed tensor at a 16-byte aligned address (the kernel copies 16-byte pieces)."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.zeros(nbytes + 16, dtype=torch.uint8)
    start = (-raw.data_ptr()) % 16
    return raw[start:start + nbytes].view(dtype).view(shape)


def inputs(n):
    return (aligned((n, SHAPE.hidden), torch.float8_e4m3fn), aligned((n, SHAPE.hidden // 128), torch.float32),
            aligned((n, SHAPE.num_topk), torch.int64), aligned((n, SHAPE.num_topk), torch.float32))


@pytest.fixture
def plans(monkeypatch):
    """Every plan mega_moe builds, with the launch recorded instead of made."""
    built = []

    def plan(buf, l1, l2, config):
        built.append(launch.LaunchPlan(Kernel(), (1, 1, 1), (1, 1, 1), bytes(128), Y_OFFSET, NUM_TOKENS_OFFSET,
                                       INPUTS_OFFSET))
        return built[-1]

    monkeypatch.setattr(fused, "build_plan", plan)
    monkeypatch.setattr(fused, "current_stream", lambda device: 0x5EED)
    return built


def call(buf, l1, l2, n=3, given=None, y=None):
    y = torch.empty(n, SHAPE.hidden, dtype=torch.bfloat16) if y is None else y
    x, x_sf, topk_idx, topk_weights = inputs(n) if given is None else given
    fused.mega_moe(y, l1, l2, buf, x=x, x_sf=x_sf, topk_idx=topk_idx, topk_weights=topk_weights,
                   config=KernelConfig(block_m=64))
    return y, (x, x_sf, topk_idx, topk_weights)


def block(plan):
    params = bytes(plan.prepared.params)
    return (struct.unpack_from("<Q", params, Y_OFFSET)[0], struct.unpack_from("<Q", params, NUM_TOKENS_OFFSET)[0],
            struct.unpack_from("<4Q", params, INPUTS_OFFSET))


def test_each_call_writes_its_output_tokens_and_inputs_and_launches_once(plans):
    buf, (l1, l2) = cpu_buffer(), weights()
    y, given = call(buf, l1, l2, n=3)
    (plan,) = plans
    assert block(plan) == (y.data_ptr(), 3, tuple(t.data_ptr() for t in given))
    y2, _ = call(buf, l1, l2, n=2, given=buf_views(buf, 2))
    assert len(plans) == 1, "the same weights and config reuse the plan"
    assert block(plan) == (y2.data_ptr(), 2, (0, 0, 0, 0)), "the buffer's own views: nothing to copy"
    assert plan.prepared.streams == [0x5EED, 0x5EED]


def buf_views(buf, n):
    return tuple(v[:n] for v in buf.inputs)


def test_other_weights_or_config_get_their_own_plan(plans):
    buf, (l1, l2) = cpu_buffer(), weights()
    call(buf, l1, l2)
    other_l1, other_l2 = weights()
    call(buf, other_l1, other_l2)
    fused.mega_moe(torch.empty(1, SHAPE.hidden, dtype=torch.bfloat16), l1, l2, buf, x=inputs(1)[0],
                   x_sf=inputs(1)[1], topk_idx=inputs(1)[2], topk_weights=inputs(1)[3],
                   config=KernelConfig(block_m=64, num_stages=4))
    assert len(plans) == 3
    call(buf, l1, l2)
    assert len(plans) == 3


def test_the_profiling_switch_gets_its_own_plan(plans, monkeypatch):
    # A process that times the release build and then sets MEGAMOE_PROFILE=1 must launch the
    # counting kernel, not the release plan it already holds.
    buf, (l1, l2) = cpu_buffer(), weights()
    monkeypatch.delenv("MEGAMOE_PROFILE", raising=False)
    call(buf, l1, l2)
    monkeypatch.setenv("MEGAMOE_PROFILE", "1")
    call(buf, l1, l2)
    assert len(plans) == 2
    monkeypatch.delenv("MEGAMOE_PROFILE")
    call(buf, l1, l2)
    assert len(plans) == 2, "back to the release plan"


def test_a_plan_serves_only_the_live_weights_it_was_built_for(plans):
    buf, (l1, l2) = cpu_buffer(), weights()
    call(buf, l1, l2)
    (plan,) = plans
    assert plan.serves(l1, l2)
    assert not plan.serves(l2, l1)
    # Storage swapped under the same objects: the tensor maps would point at the old memory.
    l1.weight.set_(torch.zeros_like(l1.weight))
    assert not plan.serves(l1, l2)
    call(buf, l1, l2)
    assert len(plans) == 2


def test_a_cached_plan_does_not_keep_dropped_weights_alive(plans):
    buf, (l1, l2) = cpu_buffer(), weights()
    call(buf, l1, l2)
    alive = weakref.ref(l1.weight)
    del l1, l2
    gc.collect()
    assert alive() is None, "the buffer's plan cache held the weights"
    (plan,) = plans
    new_l1, new_l2 = weights()
    assert not plan.serves(new_l1, new_l2), "a dead plan's weights never match, whatever id comes back"


@pytest.mark.parametrize("change,message", [
    (lambda g, y: (g, y.float()), "y must be torch.bfloat16, got torch.float32"),
    (lambda g, y: (g, y[:, :256]), r"y must have shape \(3, 512\), got \(3, 256\)"),
    (lambda g, y: (inputs(2), y), "x has 2 rows and y 3"),
    (lambda g, y: (g[:1] + (g[1].t().contiguous().t(),) + g[2:], y), "x_sf must be contiguous"),
    (lambda g, y: (g[:2] + (g[2].int(),) + g[3:], y), "topk_idx must be torch.int64, got torch.int32"),
])
def test_bad_input_is_still_refused_by_name(plans, change, message):
    buf, (l1, l2) = cpu_buffer(), weights()
    given, y = change(inputs(3), torch.empty(3, SHAPE.hidden, dtype=torch.bfloat16))
    with pytest.raises(MegaMoEError, match=message):
        call(buf, l1, l2, n=3, given=given, y=y)
    assert all(not p.prepared.streams for p in plans), "nothing launched"


def test_an_input_inside_the_buffer_is_still_refused(plans):
    buf, (l1, l2) = cpu_buffer(), weights()
    given = inputs(3)
    with pytest.raises(MegaMoEError, match="topk_idx lies inside the symmetric buffer"):
        call(buf, l1, l2, n=3, given=given[:2] + (buf.topk_idx[1:4],) + given[3:])
