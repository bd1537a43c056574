/* Native CPU kernels for SwitchML's block floating point; bfp_native.py is the Python side and
bfp.py's torch code the reference (and the fallback): the results agree bit for bit. The kernels
themselves are in bfp_core.h, which the worker's pump (net/_pump.c) includes too.

Entry points take raw addresses (tensor.data_ptr()) that bfp_native.py has checked: CPU,
contiguous, the right dtype and size. They release the GIL, so worker threads overlap.

  summarize  per block: the frexp exponent of max |x| (EXPONENT_FLOOR for an all-zero block),
             and whether x is finite, in one pass
  encode     per block: x * 2**shift, clamped to +-limit, rounded half to even, to int32; shift =
             min(30 - headroom - exponent, 120), computed from the shared exponents
  sum        the aggregator: n-way int32 sum (wrapping, as torch's)
  decode     per block: float(sum) / contributors * 2**-shift
  supported  whether every shared exponent gives a shift the kernels take

Every pass is memory bound: one read of the input and (encode, decode) one write of the output,
no temporaries. Lengths need not be a multiple of the block size: the last block is shorter.

Exactness: the scales are powers of two built from their bits (the kernels accept only integral
shifts in [-126, 120], so 2**shift and 2**-shift are normal floats; anything else is refused and
the caller runs torch). Products, the float clamp, rounding half to even (rintf under the default
rounding mode, as torch.round's nearbyint) and int<->float conversions are single IEEE
operations, the same ones torch performs. Built with -ffp-contract=off (no fused multiply-adds).

Portability: plain C loops written for the auto-vectorizer (it finds min/max/round/convert
instructions that GCC's vector extensions cannot spell portably), compiled on x86-64 with AVX2
and SSE4.1 clones picked at load time (no -march flags; the AVX2 encode loop is 9 instructions
per 8 coordinates) and a baseline clone for any x86-64 (its encode is scalar: SSE2 has no vector
rounding instruction; ~15x slower, still exact); elsewhere plain C. -DGRADSUM_BASELINE_ONLY
builds the baseline alone (to test it: the results must not change).
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bfp_core.h"

/* ---------------------------------------------------------------------------------------------
 * Python entry points
 */

#define ADDRESS(type, value) ((type)(uintptr_t)(value))

static int check_sizes(Py_ssize_t n, Py_ssize_t block) {
    if (n < 0 || block < 1) {
        PyErr_Format(PyExc_ValueError, "bad length %zd or block size %zd", n, block);
        return 0;
    }
    return 1;
}

static int check_headroom(int headroom) {
    if (headroom < 0 || headroom > 31) {
        PyErr_Format(PyExc_ValueError, "headroom %d is not in 0..31", headroom);
        return 0;
    }
    return 1;
}

PyDoc_STRVAR(summarize_doc,
             "summarize(x, n, block, exponents) -> bool\n"
             "exponents[b] = frexp exponent of max |x| over block b of x[0:n] (float32; -126 for\n"
             "an all-zero block). Returns False where x holds an Inf or NaN.");

static PyObject *py_summarize(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long x, exponents;
    Py_ssize_t n, block;
    if (!PyArg_ParseTuple(args, "KnnK", &x, &n, &block, &exponents) || !check_sizes(n, block))
        return NULL;
    int finite;
    Py_BEGIN_ALLOW_THREADS
    finite = bfp_summarize(ADDRESS(const float *, x), (size_t)n, (size_t)block,
                       ADDRESS(float *, exponents));
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(finite);
}

/* Blocks [*from, *to) that coordinates [first, first + n) fall in. */
static void blocks_of(size_t first, size_t n, size_t block, size_t *from, size_t *to) {
    *from = first / block;
    *to = n ? (first + n - 1) / block + 1 : *from;
}

PyDoc_STRVAR(encode_doc,
             "encode(x, first, n, block, shared, headroom, limit, out) -> int\n"
             "out[i - first] = int32(round(clamp(x[i] * 2**shift, -limit, limit))) for i in\n"
             "[first, first + n), with shift of i's block (blocks from x[0]) = min(30 - headroom -\n"
             "shared[block], 120). Returns 1, 0 where those x hold an Inf or NaN, or -1 (out\n"
             "untouched) where some shift is not an integer in [-126, 120].");

static PyObject *py_encode(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long x, shared, out;
    Py_ssize_t first, n, block;
    int headroom;
    float limit;
    if (!PyArg_ParseTuple(args, "KnnnKifK", &x, &first, &n, &block, &shared, &headroom, &limit,
                          &out) ||
        !check_sizes(n, block) || !check_sizes(first, block) || !check_headroom(headroom))
        return NULL;
    if (!(limit >= 0 && limit < 2147483648.0f)) {
        PyErr_Format(PyExc_ValueError, "limit %f does not fit int32", (double)limit);
        return NULL;
    }
    size_t from, to;
    blocks_of((size_t)first, (size_t)n, (size_t)block, &from, &to);
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = shifts_supported(ADDRESS(const float *, shared) + from, to - from, headroom)
                 ? bfp_encode(ADDRESS(const float *, x), (size_t)first, (size_t)n, (size_t)block,
                              ADDRESS(const float *, shared), headroom, limit,
                              ADDRESS(int32_t *, out))
                 : -1;
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(status);
}

PyDoc_STRVAR(sum_doc,
             "sum(payloads, n, out)\n"
             "out[0:n] = the int32 sum (wrapping) of the payloads (addresses of int32 arrays).");

static PyObject *py_sum(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *addresses;
    unsigned long long out;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OnK", &addresses, &n, &out) || !check_sizes(n, 1))
        return NULL;
    PyObject *sequence = PySequence_Fast(addresses, "payloads must be a sequence of addresses");
    if (!sequence)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(sequence);
    if (count < 1) {
        Py_DECREF(sequence);
        PyErr_SetString(PyExc_ValueError, "sum needs at least one payload");
        return NULL;
    }
    const uint32_t **payloads = PyMem_Malloc((size_t)count * sizeof *payloads);
    if (!payloads) {
        Py_DECREF(sequence);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t p = 0; p < count; p++)
        payloads[p] = PyLong_AsVoidPtr(PySequence_Fast_GET_ITEM(sequence, p));
    Py_DECREF(sequence);
    if (PyErr_Occurred()) {
        PyMem_Free(payloads);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    bfp_sum(payloads, (size_t)count, (size_t)n, ADDRESS(uint32_t *, out));
    Py_END_ALLOW_THREADS
    PyMem_Free(payloads);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(decode_doc,
             "decode(values, first, n, block, shared, headroom, contributors, out) -> bool\n"
             "out[i] = float(values[i - first]) / contributors * 2**-shift for i in [first,\n"
             "first + n), shift as in encode. Returns False (out untouched) where some shift is\n"
             "not an integer in [-126, 120].");

static PyObject *py_decode(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long values, shared, out;
    Py_ssize_t first, n, block;
    int headroom, contributors;
    if (!PyArg_ParseTuple(args, "KnnnKiiK", &values, &first, &n, &block, &shared, &headroom,
                          &contributors, &out) ||
        !check_sizes(n, block) || !check_sizes(first, block) || !check_headroom(headroom))
        return NULL;
    if (contributors < 1 || contributors > 1 << 24) {
        PyErr_Format(PyExc_ValueError, "contributors %d is not in 1..2**24", contributors);
        return NULL;
    }
    size_t from, to;
    blocks_of((size_t)first, (size_t)n, (size_t)block, &from, &to);
    int supported;
    Py_BEGIN_ALLOW_THREADS
    supported = shifts_supported(ADDRESS(const float *, shared) + from, to - from, headroom);
    if (supported)
        bfp_decode(ADDRESS(const int32_t *, values), (size_t)first, (size_t)n, (size_t)block,
                   ADDRESS(const float *, shared), headroom, contributors,
                   ADDRESS(float *, out));
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(supported);
}

PyDoc_STRVAR(supported_doc,
             "supported(shared, blocks, headroom) -> bool\n"
             "Whether every shift min(30 - headroom - shared[b], 120), b < blocks, is an integer\n"
             "in [-126, 120]: what encode and decode take.");

static PyObject *py_supported(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long shared;
    Py_ssize_t blocks;
    int headroom;
    if (!PyArg_ParseTuple(args, "Kni", &shared, &blocks, &headroom) || !check_sizes(blocks, 1) ||
        !check_headroom(headroom))
        return NULL;
    return PyBool_FromLong(shifts_supported(ADDRESS(const float *, shared), (size_t)blocks,
                                            headroom));
}

static PyMethodDef methods[] = {
    {"summarize", py_summarize, METH_VARARGS, summarize_doc},
    {"encode", py_encode, METH_VARARGS, encode_doc},
    {"sum", py_sum, METH_VARARGS, sum_doc},
    {"decode", py_decode, METH_VARARGS, decode_doc},
    {"supported", py_supported, METH_VARARGS, supported_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_bfp_kernels",
    .m_doc = "Native CPU kernels for block floating point (see bfp_native.py).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__bfp_kernels(void) { return PyModule_Create(&module); }
