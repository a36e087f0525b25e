"""The C kernels of QSGD (src/sparsync/compress/_qsgd_c.c). Everything else is in pyproject.toml.

optional=True: without a C compiler the install still succeeds and QSGD runs its torch kernels (the same bits).
-ffp-contract=off: no fused multiply-add, so the C kernels round exactly as the torch ones do.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "sparsync.compress._qsgd_c",
            ["src/sparsync/compress/_qsgd_c.c"],
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno", "-std=c11"],
            optional=True,
        )
    ]
)
