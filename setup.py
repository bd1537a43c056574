"""Builds the optional C kernels of THC; all package metadata lives in pyproject.toml.

The extension is optional: without a working C compiler the build skips it and gradsum runs
its torch code instead (see src/gradsum/codecs/thc/native.py).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "gradsum.codecs.thc._kernels",
            sources=["src/gradsum/codecs/thc/_kernels.c"],
            extra_compile_args=["-O3", "-std=gnu11", "-Wno-psabi"],
            optional=True,
        )
    ]
)
