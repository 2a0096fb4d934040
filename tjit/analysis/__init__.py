"""Exact analyses of memory accesses (integer sets)."""
