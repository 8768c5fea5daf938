"""Build hook for kvtier's optional C extensions (metadata lives in pyproject.toml).

* ``kvtier.tiers._rawread`` is the SSD tier's batched read path for raw values.
* ``kvtier.tiers._rq`` runs the loops of the rotation-quantizer codecs
  (``rq4``, ``rq3``: kvtier/tiers/rq.py).

Both are optional: where no C compiler is present the build skips them and
kvtier runs its pure-Python paths (same results, slower; see
kvtier/tiers/ssd.py and kvtier/tiers/rq.py).
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
        ),
        Extension(
            "kvtier.tiers._rq",
            sources=["kvtier/tiers/_rq.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ]
)
