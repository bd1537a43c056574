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
                     "a": "*fp32", "c": "*fp32", "seed_lo": "u32", "seed_hi": "i32"}
    # a step's rows (thc.step)
    F, ROW = "*fp32", {"meta": "*i64", "lengths": "*i64", "P": "i32", "N": "i32"}
    ROTATE_ARGS = {"src": F, "memory": F, "norms": F, "xp": F, "dst": F, "signs": F,
                   "scales": F, "bound": "fp32", "divisors": F, **ROW}
    ROWS_CROSS_ARGS = {"buf": F, "memory": F, "norms": F, "signs": F, "scales": F, "xp": F,
                       "out": F, "bound": "fp32", "factors": F, **ROW}
    DEQUANTIZE_ARGS = {"sums": "*u8", "dst": F, "step": "*fp64", "offset": F, "values": "*i32",
                       "signs": F, "scales": F, "xp": F, "out": F, "factors": F,
                       "contributors": "i32", "meta": "*i64", "lengths": "*i64", "N": "i32"}
    ROWS_QUANTIZE_ARGS = {"y": F, "seeds": "*i64", "low_of_cell": F, "inverse_width": F,
                          "interval": "*u8", "packed": "*u8", "a": F, "c": "fp32",
                          "meta": "*i64", "values": "*i32", "step": F, "offset": F,
                          "error": F, "N": "i32"}
    SCALARS_ARGS = {"shared": F, "sqrt_padded": "*fp64", "constants": "*fp64", "a": F,
                    "step": "*fp64", "step32": F, "offset": F, "own_offset": F, "ok": "*i8",
                    "prior": "*i8", "P": "i32"}
    TENSOR_SCALES_ARGS = {"shared": F, "meta": "*i64", "sqrt_lengths": "*fp64",
                          "largest": "*fp64", "factors": F, "divisors": F, "ok": "*i8",
                          "plain": "i32", "pieces": "i32", "W": "i32"}
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
        for hashed in (False, True):
            cases.append((k._quantize_kernel, QUANTIZE_ARGS, dict(
                g=2 ** (bits + 1) - 2, BITS=bits, N=TILE, HASHED=hashed)))
    K, LOG_TILE = 11, TILE.bit_length() - 1
    for xp, memory, bound, pieces, select in ((False, False, False, False, 0),
                                              (True, True, True, False, 0),
                                              (True, True, True, False, 1),
                                              (False, False, False, True, 2)):
        cases.append((k._rows_rotate_kernel, ROTATE_ARGS, dict(
            K=K, T=TILE, LOG_T=LOG_TILE, XP=xp, MEMORY=memory, BOUND=bound, PIECES=pieces,
            SELECT=select)))
    for decode, memory, residual, pieces, select in ((False, True, False, False, 1),
                                                     (False, False, False, False, 2),
                                                     (True, False, False, True, 0),
                                                     (True, False, True, True, 0)):
        cases.append((k._rows_cross_kernel, ROWS_CROSS_ARGS, dict(
            K=K, RM=256, LOG_RM=8, T=TILE, LOG_T=LOG_TILE, C=COLUMNS, DECODE=decode,
            MEMORY=memory, BOUND=memory, RESIDUAL=residual, PIECES=pieces, SELECT=select)))
    for width, lookup, residual, pieces in ((7, False, False, False), (4, True, True, True),
                                            (16, False, False, True)):
        cases.append((k._rows_dequantize_kernel, DEQUANTIZE_ARGS, dict(
            K=K, T=TILE, LOG_T=LOG_TILE, WIDTH=width, LOOKUP=lookup, RESIDUAL=residual,
            PIECES=pieces)))
    for error in (False, True):
        cases.append((k._rows_quantize_kernel, ROWS_QUANTIZE_ARGS, dict(
            K=K, g=30, BITS=4, NT=TILE, ERROR=error)))
    for prior in (False, True):
        cases.append((k._rows_scalars_kernel, {**SCALARS_ARGS, "shared": "*fp64"} if prior
                      else SCALARS_ARGS, dict(BLOCK=64, PRIOR=prior)))
    cases.append((k._rows_tensor_scales_kernel, TENSOR_SCALES_ARGS, dict(K=K, WB=4)))
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
    assert "compiled 48 kernels for sm_90 and sm_80" in result.stdout
