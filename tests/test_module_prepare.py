"""CPU tier: what lets a CUDA graph capture `MegaMoE`'s first forward, without a GPU.

Once the buffer exists and the weights are loaded, the module chooses the config of every token
bucket up to its capacity and builds each launch plan (``fused.prepare_call``), so that any bound
a call passes finds its kernel loaded (``fused.is_prepared``); a forward being captured whose
kernel is not loaded is refused with one line instead of loading it (which capture does not
allow).  The buffer is a stand-in without device memory and plans are counted, not built.
"""

from types import SimpleNamespace

import pytest
import torch

from megamoe_cli import fused
from megamoe_cli.errors import MegaMoEError
from megamoe_cli.kernel import tuned
from megamoe_cli.kernel.kernel_source import KernelConfig
from megamoe_cli.layout import BufferConfig
from megamoe_cli.module import MegaMoE

DIMS = dict(hidden=512, intermediate=256, num_experts=16, num_topk=4)


class CountedPlan:
    """What ``fused`` asks of a launch plan, without a kernel: which weights it serves."""

    def __init__(self, config):
        self.config = config
        self.weights = None

    def bind(self, l1, l2):
        self.weights = (l1, l2)

    def serves(self, l1, l2):
        return self.weights is not None and self.weights[0] is l1 and self.weights[1] is l2


@pytest.fixture
def built(tmp_path, monkeypatch):
    """The configs plans were built for, in order (an empty tuned store of this test's own)."""
    monkeypatch.setenv(tuned.ENV_VAR, str(tmp_path / "tuned.json"))
    configs = []

    def build_plan(buf, l1, l2, config):
        configs.append(config)
        return CountedPlan(config)

    monkeypatch.setattr(fused, "build_plan", build_plan)
    return configs


def stand_in_module(capacity, weights="mxfp4", config=None):
    """A module as the constructor leaves it on a GPU, its buffer a stand-in without device memory."""
    moe = MegaMoE(**DIMS, num_max_tokens_per_rank=capacity, weights=weights, device="cpu", config=config)
    buf = object.__new__(fused.SymmBuffer)
    buf.config, buf.gpu_name, buf.closed = BufferConfig(1, capacity, moe.shape), "NVIDIA H200", False
    buf.call_configs, buf.bucket_configs, buf.plans = {}, {}, {}
    moe.device = torch.device("cuda", 0)
    moe.symm_buffer = buf
    weights = (fused.ExpertWeights(torch.empty(0), torch.empty(0)), fused.ExpertWeights(torch.empty(0), torch.empty(0)))
    return moe, buf, weights


@pytest.mark.parametrize("capacity", [1, 64, 100, 4096])
def test_every_bound_finds_its_kernel_loaded(built, capacity):
    moe, buf, weights = stand_in_module(capacity)
    l1, l2 = weights
    assert not fused.is_prepared(buf, l1, l2, None)
    moe._weights = weights
    moe._prepare_kernels()
    for bound in (None, *range(0, capacity + 1)):
        assert fused.is_prepared(buf, l1, l2, bound), bound
    # one plan per distinct config, whatever the number of buckets
    assert len(built) == len(set(built)) == len(buf.plans)
    assert set(built) == {c for c, _ in buf.bucket_configs.values()}
    # other weights (a reload) are not served by these plans
    other = fused.ExpertWeights(torch.empty(0), torch.empty(0))
    assert not fused.is_prepared(buf, other, l2, None)


def test_a_given_config_is_the_only_one_loaded(built):
    config = KernelConfig(block_m=64, num_stages=4)
    moe, buf, weights = stand_in_module(256, config=config)
    moe._weights = weights
    moe._prepare_kernels()
    assert built == [config]
    assert fused.is_prepared(buf, *weights, None, config) and fused.is_prepared(buf, *weights, 3, config)
    assert not fused.is_prepared(buf, *weights, 3)  # the per-bound choice was never made


def test_a_capture_whose_kernel_is_not_loaded_is_refused(built, monkeypatch):
    moe, buf, weights = stand_in_module(64)
    moe._weights = weights
    moe._prepare_kernels()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    # other weights (a reload after the kernels were loaded) have no plan yet: loading one is refused
    other = fused.ExpertWeights(torch.empty(0), torch.empty(0))
    with pytest.raises(MegaMoEError, match=r"^mega_moe: the kernel for num_tokens_bound=8 \(KernelConfig\(block_m=64.*"
                                           r"\) is not loaded, and a kernel cannot be loaded during CUDA-graph capture; "
                                           r"call fused.prepare_call\(buf, l1, l2, num_tokens_bound\) before capturing"):
        fused.mega_moe(None, other, weights[1], buf, num_tokens_bound=8)
    loaded = len(built)
    with pytest.raises(MegaMoEError, match="cannot be loaded during CUDA-graph capture"):
        fused.prepare_call(buf, other, weights[1], None)
    assert len(built) == loaded, "nothing was built while capturing"


def test_a_forward_without_a_buffer_says_to_allocate():
    moe = MegaMoE(**DIMS, num_max_tokens_per_rank=8, device="cpu")
    moe.device, moe._weights = torch.device("cuda", 0), (None, None)
    with pytest.raises(MegaMoEError, match=r"^MegaMoE: no symmetric buffer; call allocate\(\) on every rank first"):
        moe._fused_forward(*(SimpleNamespace(shape=(2,)),) * 4, None)
