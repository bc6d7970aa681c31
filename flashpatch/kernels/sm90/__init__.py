"""Warp-specialized Gluon kernels for Hopper (sm_90): forward (fwd), dK/dV (dkdv), dQ (dq), the helpers they share
(common) and the persistent causal forward's block table (schedule)."""
