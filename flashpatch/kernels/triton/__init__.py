"""The Triton kernels, for every GPU Triton targets and for the CPU interpreter: forward, backward (preprocess, dK/dV,
dQ), the dropout pattern, and the helpers they share (common: masks, grid order, Philox keep bits)."""
