"""The kernels and their launch settings. Imported by flashpatch.ops only; they know nothing of autograd or of the
reference.

  triton/     the Triton kernels: every GPU Triton targets, and the CPU through the interpreter
  sm90/       warp-specialized Gluon kernels for Hopper, which take the calls in their scope there
  config.py   the tiles and kernel choices measured per head dim and case (docs/tuning.md)
  options.py  the kernels' switches as one frozen value, and `override`, the one way to change them or config's pick
"""
