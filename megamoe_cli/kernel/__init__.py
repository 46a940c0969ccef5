"""The fused kernel's host side: the host/device contract (``contract``), the generated translation
unit and its variants (``kernel_source``), the weights' re-layout for the kernel (``weight_layout``),
the config choice (``heuristics``, ``tuned``) and the JIT that builds and loads cubins (``jit``).

Nothing is imported here: ``megamoe --help`` and the CPU-only paths import what they use."""
