/* Native CPU kernels for SwitchML's block floating point; bfp_native.py is the Python side and
bfp.py's torch code the reference (and the fallback): the results agree bit for bit.

Entry points take raw addresses (tensor.data_ptr()) that bfp_native.py has checked: CPU,
contiguous, the right dtype and size. They release the GIL, so worker threads overlap.

  summarize  per block: the frexp exponent of max |x| (EXPONENT_FLOOR for an all-zero block),
             and whether x is finite, in one pass
  encode     per block: x * 2**shift, clamped to +-limit, rounded half to even, to int32; shift =
             min(30 - headroom - exponent, 120), computed from the shared exponents
  sum        the aggregator: n-way int32 sum (wrapping, as torch's)
  decode     per block: float(sum) * (2**-shift / contributors)

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

#if defined(__x86_64__) && defined(__has_attribute) && !defined(GRADSUM_BASELINE_ONLY)
#if __has_attribute(target_clones)
#define MULTIVERSION __attribute__((target_clones("avx2", "sse4.1", "default")))
#endif
#endif
#ifndef MULTIVERSION
#define MULTIVERSION
#endif

#define INLINE static inline __attribute__((always_inline))
#define MIN(a, b) ((a) < (b) ? (a) : (b))

enum {
    EXPONENT_FLOOR = -126, /* bfp.py's exponent of an all-zero block */
    MAX_SHIFT = 120,       /* bfp.py clamps shifts here */
    MIN_SHIFT = -126,      /* below, 2**shift would not be a normal float: left to torch */
    ABS_MASK = 0x7fffffff,
    INF_BITS = 0x7f800000, /* |x|'s bits at or above: Inf or NaN */
    SUM_CHUNK = 2048,      /* int32 lanes summed in L1 (8 KiB) while the payloads stream by */
};

INLINE float power_of_two(int s) { /* s in [-126, 127] */
    uint32_t bits = (uint32_t)(s + 127) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The integral shift of a block with shared exponent e, or INT32_MIN where bfp.py's
   (30 - headroom) - e, clamped at MAX_SHIFT, is not an integer in [MIN_SHIFT, MAX_SHIFT]. */
INLINE int block_shift(float e, int headroom) {
    float s = (float)(30 - headroom) - e;
    if (s > MAX_SHIFT) s = MAX_SHIFT;
    if (!(s >= MIN_SHIFT)) return INT32_MIN; /* also NaN */
    int k = (int)s;
    return (float)k == s ? k : INT32_MIN;
}

static int shifts_supported(const float *shared, size_t blocks, int headroom) {
    for (size_t b = 0; b < blocks; b++)
        if (block_shift(shared[b], headroom) == INT32_MIN) return 0;
    return 1;
}

/* ---------------------------------------------------------------------------------------------
 * summarize: the largest |x| of a block is the largest of its bit patterns with the sign cleared
 * (an integer max: no float compare, and Inf/NaN show up as patterns >= INF_BITS).
 */

INLINE int32_t block_abs_max(const float *restrict x, size_t count) {
    int32_t m = 0;
    for (size_t i = 0; i < count; i++) {
        int32_t bits;
        memcpy(&bits, x + i, sizeof bits);
        bits &= ABS_MASK;
        m = bits > m ? bits : m;
    }
    return m;
}

/* frexp's exponent of the float with bits m (finite, non-negative); EXPONENT_FLOOR for 0. */
INLINE int frexp_exponent(int32_t m) {
    if (m == 0) return EXPONENT_FLOOR;
    if (m >= 1 << 23) return (m >> 23) - 126;
    return -117 - __builtin_clz((unsigned)m); /* subnormal: m * 2**-149 */
}

/* exponents[b] for every block of x[0, n); returns whether x is all finite. */
MULTIVERSION static int summarize(const float *restrict x, size_t n, size_t block,
                                  float *restrict exponents) {
    int32_t worst = 0;
    for (size_t start = 0, b = 0; start < n; start += block, b++) {
        int32_t m = block_abs_max(x + start, MIN(block, n - start));
        worst = m > worst ? m : worst;
        exponents[b] = (float)frexp_exponent(m);
    }
    return worst < INF_BITS;
}

/* ---------------------------------------------------------------------------------------------
 * encode: round(clamp(x * scale, -limit, limit)) per block. Clamping first is the same: limit is
 * an integer, and rounding is monotone. rintf rounds half to even under the default rounding mode
 * (torch.round's nearbyint does too); the conversion after it is exact. The largest |x| bit
 * pattern is tracked on the side, as in summarize, for the finiteness check.
 */

INLINE int32_t quantize_block(const float *restrict x, size_t count, float scale, float limit,
                              int32_t *restrict out) {
    int32_t m = 0;
    for (size_t i = 0; i < count; i++) {
        float v = x[i];
        int32_t bits;
        memcpy(&bits, &v, sizeof bits);
        bits &= ABS_MASK;
        m = bits > m ? bits : m;
        float y = v * scale;
        y = y > limit ? limit : y;
        y = y < -limit ? -limit : y;
        out[i] = (int32_t)rintf(y);
    }
    return m;
}

MULTIVERSION static int encode(const float *restrict x, size_t n, size_t block,
                               const float *restrict shared, int headroom, float limit,
                               int32_t *restrict out) {
    int32_t worst = 0;
    for (size_t start = 0, b = 0; start < n; start += block, b++) {
        float scale = power_of_two(block_shift(shared[b], headroom));
        int32_t m = quantize_block(x + start, MIN(block, n - start), scale, limit, out + start);
        worst = m > worst ? m : worst;
    }
    return worst < INF_BITS;
}

/* ---------------------------------------------------------------------------------------------
 * sum and decode
 */

/* out = sum of count payloads, chunk by chunk so the running sum stays in L1. Unsigned adds:
   two's complement wrap-around, like torch's int32 +=, without C's signed-overflow UB. */
MULTIVERSION static void sum(const uint32_t *const *payloads, size_t count, size_t n,
                             uint32_t *restrict out) {
    for (size_t start = 0; start < n; start += SUM_CHUNK) {
        size_t end = MIN(n, start + SUM_CHUNK);
        const uint32_t *restrict first = payloads[0];
        if (count == 1) {
            memcpy(out + start, first + start, (end - start) * sizeof *out);
            continue;
        }
        const uint32_t *restrict second = payloads[1];
        for (size_t i = start; i < end; i++) out[i] = first[i] + second[i];
        for (size_t p = 2; p < count; p++) {
            const uint32_t *restrict next = payloads[p];
            for (size_t i = start; i < end; i++) out[i] += next[i];
        }
    }
}

MULTIVERSION static void decode(const int32_t *restrict values, size_t n, size_t block,
                                const float *restrict shared, int headroom, float contributors,
                                float *restrict out) {
    for (size_t start = 0, b = 0; start < n; start += block, b++) {
        /* bfp.py: exp2(-shift) / contributors, then times the float sum */
        float inverse = power_of_two(-block_shift(shared[b], headroom)) / contributors;
        size_t end = MIN(n, start + block);
        for (size_t i = start; i < end; i++) out[i] = (float)values[i] * inverse;
    }
}

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
    finite = summarize(ADDRESS(const float *, x), (size_t)n, (size_t)block,
                       ADDRESS(float *, exponents));
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(finite);
}

PyDoc_STRVAR(encode_doc,
             "encode(x, n, block, shared, headroom, limit, out) -> int\n"
             "out[i] = int32(round(clamp(x[i] * 2**shift, -limit, limit))) with shift of i's\n"
             "block = min(30 - headroom - shared[block], 120). Returns 1, 0 where x holds an Inf\n"
             "or NaN, or -1 (out untouched) where some shift is not an integer in [-126, 120].");

static PyObject *py_encode(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long x, shared, out;
    Py_ssize_t n, block;
    int headroom;
    float limit;
    if (!PyArg_ParseTuple(args, "KnnKifK", &x, &n, &block, &shared, &headroom, &limit, &out) ||
        !check_sizes(n, block) || !check_headroom(headroom))
        return NULL;
    if (!(limit >= 0 && limit < 2147483648.0f)) {
        PyErr_Format(PyExc_ValueError, "limit %f does not fit int32", (double)limit);
        return NULL;
    }
    size_t blocks = ((size_t)n + (size_t)block - 1) / (size_t)block;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = shifts_supported(ADDRESS(const float *, shared), blocks, headroom)
                 ? encode(ADDRESS(const float *, x), (size_t)n, (size_t)block,
                          ADDRESS(const float *, shared), headroom, limit, ADDRESS(int32_t *, out))
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
    sum(payloads, (size_t)count, (size_t)n, ADDRESS(uint32_t *, out));
    Py_END_ALLOW_THREADS
    PyMem_Free(payloads);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(decode_doc,
             "decode(values, n, block, shared, headroom, contributors, out) -> bool\n"
             "out[i] = float(values[i]) * (2**-shift / contributors), shift as in encode.\n"
             "Returns False (out untouched) where some shift is not an integer in [-126, 120].");

static PyObject *py_decode(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long values, shared, out;
    Py_ssize_t n, block;
    int headroom, contributors;
    if (!PyArg_ParseTuple(args, "KnnKiiK", &values, &n, &block, &shared, &headroom,
                          &contributors, &out) ||
        !check_sizes(n, block) || !check_headroom(headroom))
        return NULL;
    if (contributors < 1 || contributors > 1 << 24) {
        PyErr_Format(PyExc_ValueError, "contributors %d is not in 1..2**24", contributors);
        return NULL;
    }
    size_t blocks = ((size_t)n + (size_t)block - 1) / (size_t)block;
    int supported;
    Py_BEGIN_ALLOW_THREADS
    supported = shifts_supported(ADDRESS(const float *, shared), blocks, headroom);
    if (supported)
        decode(ADDRESS(const int32_t *, values), (size_t)n, (size_t)block,
               ADDRESS(const float *, shared), headroom, (float)contributors,
               ADDRESS(float *, out));
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(supported);
}

static PyMethodDef methods[] = {
    {"summarize", py_summarize, METH_VARARGS, summarize_doc},
    {"encode", py_encode, METH_VARARGS, encode_doc},
    {"sum", py_sum, METH_VARARGS, sum_doc},
    {"decode", py_decode, METH_VARARGS, decode_doc},
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
