"""Build hook for kvtier's optional C extensions (metadata lives in pyproject.toml).

* ``kvtier.tiers._rawread`` is the SSD tier's batched read path for raw values.
* ``kvtier.tiers._rq`` runs the loops of the rotation-quantizer codecs
  (``rq4``, ``rq3``: kvtier/tiers/rq.py).

Both are optional: where no C compiler (or, for ``_rawread``, no xxHash
library) is present the build skips them and
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
            # XXH3-64 from the system's xxHash library (Debian/Ubuntu: libxxhash0, which apt
            # itself depends on); where it is absent the link fails and, optional, the module is skipped
            libraries=[":libxxhash.so.0"] if sys.platform.startswith("linux") else ["xxhash"],
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
