"""Fused kernels (shipped as mppo.kernels)."""
