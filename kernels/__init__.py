"""Torch references and Triton kernels for CSA2 and Engram; call them via ``kernels.dispatch``."""
