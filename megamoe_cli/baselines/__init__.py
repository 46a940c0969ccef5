"""The layers the fused kernel is measured against: our unfused PyTorch pipelines
(``torch_fp8`` with its Triton kernels ``triton_fp8``, ``torch_bf16``) and other projects' layers
(``peers``).  ``megamoe_cli.backends`` names them as benchmark backends."""
