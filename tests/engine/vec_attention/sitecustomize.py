"""Loaded at start-up by every Python process whose ``PYTHONPATH`` holds this directory
(``engine_child.py`` puts it there for a scenario with ``"cpu_attention": "vec"``; vLLM's
CPU platform spawns its engine processes, which inherit it). It makes vLLM's CPU backend
choose its ``vec`` attention kernels on a CPU with AMX tiles too, where it would pick AMX
ones for bf16. Test support only: nothing outside tests/engine puts it on a path."""

import os

if os.environ.get("KVTIERTEST_CPU_ATTENTION") == "vec":
    import torch

    torch.cpu._is_amx_tile_supported = lambda: False
