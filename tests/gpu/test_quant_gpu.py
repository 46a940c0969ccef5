"""Quantization on the GPU gives the CPU's bits: the GPU tier quantizes inputs and requantizes the
reference's activations on the GPU, the CPU tests on the CPU, and the kernel divides correctly
rounded; a device-dependent rounding would move FP8 values across rounding boundaries."""

import pytest
import torch

from megamoe_cli.reference.quant import quantize_mxfp4, quantize_per_block, quantize_per_token

pytestmark = pytest.mark.gpu


def test_quantization_is_the_same_on_the_gpu_and_the_cpu(group):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(256, 1024, generator=g) * torch.logspace(-3, 3, 1024)
    for quantize in (quantize_per_token, quantize_per_block, quantize_mxfp4):
        cpu = quantize(x)
        gpu = quantize(x.cuda())
        for a, b in zip(cpu, gpu):
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               (b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b).cpu()), quantize.__name__
