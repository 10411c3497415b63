"""Triton kernels (being built: cache_write, flash_prefill, paged_decode)."""
