"""Build hook for kvtier's one optional C extension (metadata lives in pyproject.toml).

``kvtier.tiers._rawread`` is the SSD tier's batched read path for raw values.
It is optional: where no C compiler is present the build skips it and kvtier
runs its pure-Python read path (same results, slower; see kvtier/tiers/ssd.py).
"""

import sys

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvtier.tiers._rawread",
            sources=["kvtier/tiers/_rawread.c"],
            extra_compile_args=["-O2"],
            # dlopen/dlsym: in libc from glibc 2.34, in libdl before
            libraries=["dl"] if sys.platform.startswith("linux") else [],
            optional=True,
        )
    ]
)
