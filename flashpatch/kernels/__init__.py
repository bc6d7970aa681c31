"""Triton kernels. Imported by flashpatch.ops only; they know nothing of autograd or of the reference."""
