"""Triton pieces both Triton backends (`triton_fused` and the quantised kernels of `quant_kernels`) share.

- ``activation``: the epilogue activations and their codes;
- ``launch``: the compiled-kernel launch cache, host-side helpers and scratch buffers;
- ``align``: routing, the (token, slot) pairs grouped by expert into padded blocks on the GPU;
- ``combine``: the deterministic sum of each token's k slot rows.
- ``schedule``: which output tile each program of the grouped GEMMs computes.

Importing this package imports nothing; its modules import torch and triton.
"""
