"""megamoe: a fused MoE layer (dispatch, expert GEMMs, combine) for Hopper GPUs, and its tooling."""

__version__ = "0.1.0"
