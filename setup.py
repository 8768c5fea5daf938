"""Build hook for kvtier's one optional C extension (metadata lives in pyproject.toml).

``kvtier.tiers._rawread`` is the SSD tier's batched read path for raw values.
It is optional: where no C compiler is present the build skips it and kvtier
runs its pure-Python read path (same results, slower; see kvtier/tiers/ssd.py).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvtier.tiers._rawread",
            sources=["kvtier/tiers/_rawread.c"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
