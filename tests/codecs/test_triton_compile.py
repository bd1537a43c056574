"""The fused THC kernels compile for real GPUs, on a machine without one.

``tests/codecs/test_triton.py`` runs the kernels under ``TRITON_INTERPRET=1``, which executes
their Python and never meets Triton's compiler: a kernel the interpreter runs bit for bit can
still be refused by the compiler (a ``tl.constexpr`` bound twice in an unrolled loop was, on the
first H200). Triton compiles to machine code without a device, so every kernel is compiled here
for Hopper and Ampere with each constexpr combination ``triton_kernels`` launches, in a process
of its own (the interpreter, once set in a process, replaces ``triton.jit``)."""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

# not imported here: test_triton.py must be the first to import triton in this process
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install gradsum[gpu])", allow_module_level=True)

COMPILE_EVERY_KERNEL = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gradsum.codecs.thc import _triton as k
    from gradsum.codecs.thc.triton_kernels import COLUMNS, TILE

    TILE_ARGS = {"src": "*fp32", "dst": "*fp32", "signs": "*fp32", "sums": "*i32",
                 "length": "i32", "scale": "fp32", "a": "*fp32", "c": "*fp32"}
    CROSS_ARGS = {"buf": "*fp32", "signs": "*fp32", "scale": "fp32"}
    QUANTIZE_ARGS = {"y": "*fp32", "draws": "*fp32", "low_of_cell": "*fp32",
                     "inverse_width": "*fp32", "interval": "*i16", "packed": "*u8",
                     "a": "*fp32", "c": "*fp32"}
    PACKED_ARGS = {**TILE_ARGS, "sums": "*u8"}
    cases = []
    for tile in (4, TILE):
        for load in (0, 1, 2):
            for last in (False, True):
                cases.append((k._tile_kernel, TILE_ARGS, dict(
                    T=tile, LOG_T=tile.bit_length() - 1, LOAD=load, LAST=last, WIDTH=0)))
        for width in (1, 7, 16, 25):  # the decode's packed sums
            cases.append((k._tile_kernel, PACKED_ARGS, dict(
                T=tile, LOG_T=tile.bit_length() - 1, LOAD=2, LAST=True, WIDTH=width)))
    for rows in (2, 1024):
        for signs in (False, True):
            cases.append((k._cross_kernel, CROSS_ARGS, dict(
                R=rows, LOG_R=rows.bit_length() - 1, T=TILE, C=COLUMNS, SIGNS=signs)))
    for bits in (1, 2, 4, 8):
        cases.append((k._quantize_kernel, QUANTIZE_ARGS, dict(
            g=2 ** (bits + 1) - 2, BITS=bits, N=TILE)))
    for arch in (90, 80):
        for kernel, args, constants in cases:
            signature = {**args, **{name: "constexpr" for name in constants}}
            source = ASTSource(kernel, signature, constants)
            compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                                      options={"enable_fp_fusion": False})
            assert compiled.asm.get("cubin"), (kernel.__name__, arch, constants)
    print("compiled", len(cases), "kernels for sm_90 and sm_80")
    """
)


@pytest.mark.slow
def test_every_fused_kernel_compiles_for_hopper_and_ampere():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_EVERY_KERNEL],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "compiled 28 kernels for sm_90 and sm_80" in result.stdout
