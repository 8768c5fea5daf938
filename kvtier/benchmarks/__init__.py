"""Reproducible benchmarks behind ``kvtier bench``; each prints a table and can write JSON.

Every figure is reported next to a baseline measured in the same run (a plain
memcpy, a plain file write/read), as a ratio: this machine is shared and noisy.
"""
