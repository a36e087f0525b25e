"""The C kernels of QSGD, of the S2 sketch and of DCT-DP's threshold (src/sparsync/compress/_*_c.c), and of a
table group's step (src/sparsync/sharding/_group_c.c). Everything else is in pyproject.toml.

optional=True: without a C compiler the install still succeeds and the compressors and table groups run their
torch kernels (the same results). -ffp-contract=off: no fused multiply-add, so the C kernels round exactly as the
torch ones do.
"""

from setuptools import Extension, setup

FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-std=c11"]

setup(
    ext_modules=[
        Extension(
            f"sparsync.compress._{name}_c",
            [f"src/sparsync/compress/_{name}_c.c"],
            extra_compile_args=FLAGS,
            optional=True,
        )
        for name in ("qsgd", "sketch", "threshold")
    ]
    + [
        Extension(
            "sparsync.sharding._group_c",
            ["src/sparsync/sharding/_group_c.c"],
            extra_compile_args=FLAGS,
            optional=True,
        )
    ]
)
