"""Builds the optional C kernels of THC and of bfp, the switch's native slot pools, the worker's
datagram pump, the simulator's max-min solver and the planners' play of a PS plan; all package
metadata lives in pyproject.toml.

The extensions are optional: without a working C compiler the build skips them and gradsum runs
its torch code instead (see src/gradsum/codecs/thc/native.py and src/gradsum/codecs/bfp_native.py),
its Python data plane and transport (src/gradsum/dataplane/native_pool.py, net/pump.py), the
numpy max-min solver (src/gradsum/sim/fluid.py) and the planners' Python play
(src/gradsum/schedule/costs.py).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "gradsum.codecs.thc._kernels",
            sources=["src/gradsum/codecs/thc/_kernels.c"],
            extra_compile_args=["-O3", "-std=gnu11", "-Wno-psabi"],
            optional=True,
        ),
        Extension(
            "gradsum.codecs._bfp_kernels",
            sources=["src/gradsum/codecs/_bfp_kernels.c"],
            depends=["src/gradsum/codecs/bfp_core.h"],
            # no fused multiply-adds: the results must match torch's bit for bit
            extra_compile_args=["-O3", "-std=gnu11", "-Wno-psabi", "-ffp-contract=off"],
            optional=True,
        ),
        Extension(
            "gradsum.dataplane._pool",
            sources=["src/gradsum/dataplane/_pool.c"],
            depends=[
                "src/gradsum/codecs/thc/lanes_api.h",
                "src/gradsum/dataplane/header.h",
                "src/gradsum/net/udp_offload.h",
            ],
            extra_compile_args=["-O3", "-std=gnu11", "-Wall"],
            optional=True,
        ),
        Extension(
            "gradsum.net._pump",
            sources=["src/gradsum/net/_pump.c"],
            depends=[
                "src/gradsum/codecs/bfp_core.h",
                "src/gradsum/dataplane/header.h",
                "src/gradsum/net/udp_offload.h",
            ],
            # bfp's kernels (bfp_core.h) inside: vectorised, and no fused multiply-adds, so a
            # packet encoded or decoded here has bfp_native.py's bits
            extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-ffp-contract=off"],
            optional=True,
        ),
        Extension(
            "gradsum.schedule._play",
            sources=["src/gradsum/schedule/_play.c"],
            # no fused multiply-adds: the play must end where the Python loop does, bit for bit
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-ffp-contract=off"],
            optional=True,
        ),
        Extension(
            "gradsum.sim._maxmin",
            sources=["src/gradsum/sim/_maxmin.c"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-ffp-contract=off"],
            optional=True,
        ),
    ]
)
