/* SwitchML's block floating point on the CPU: the kernels of _bfp_kernels.c (bfp_native.py's
entry points) and of the worker's pump (net/_pump.c encodes each packet as it sends it and decodes
each result where it lands), one copy for both, so the two give the same bits. bfp.py's torch code
is the reference; see _bfp_kernels.c for the exactness argument.

  bfp_summarize  per block: the frexp exponent of max |x| (EXPONENT_FLOOR for an all-zero block),
                 and whether x is finite, in one pass
  bfp_encode     per block: x * 2**shift, clamped to +-limit, rounded half to even, to int32;
                 shift = min(30 - headroom - exponent, 120), from the shared exponents
  bfp_sum        the aggregator: n-way int32 sum (wrapping, as torch's)
  bfp_decode     per block: float(sum) / contributors * 2**-shift

Include after <math.h>, <stdint.h> and <string.h>; build with -O3 -ffp-contract=off (no fused
multiply-adds: the results must match torch's bit for bit).
*/
#ifndef GRADSUM_BFP_CORE_H
#define GRADSUM_BFP_CORE_H

#if defined(__x86_64__) && defined(__has_attribute) && !defined(GRADSUM_BASELINE_ONLY)
#if __has_attribute(target_clones)
#define MULTIVERSION __attribute__((target_clones("avx2", "sse4.1", "default")))
#endif
#endif
#ifndef MULTIVERSION
#define MULTIVERSION
#endif

#define INLINE static inline __attribute__((always_inline))
#define UNUSED __attribute__((unused)) /* an includer may use only some of the kernels */
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

UNUSED static int shifts_supported(const float *shared, size_t blocks, int headroom) {
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
UNUSED MULTIVERSION static int bfp_summarize(const float *restrict x, size_t n, size_t block,
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

/* Coordinates [first, first + n) of a vector x whose blocks start at its coordinate 0 (their
   exponents in shared), into out[0, n): a whole vector (first 0) or any run of it, such as one
   packet's lanes, with the same bits. Returns whether those coordinates are finite. */
UNUSED MULTIVERSION static int bfp_encode(const float *restrict x, size_t first, size_t n,
                                          size_t block, const float *restrict shared,
                                          int headroom, float limit, int32_t *restrict out) {
    int32_t worst = 0;
    for (size_t at = first, end = first + n; at < end;) {
        size_t b = at / block, stop = MIN(end, (b + 1) * block);
        float scale = power_of_two(block_shift(shared[b], headroom));
        int32_t m = quantize_block(x + at, stop - at, scale, limit, out + (at - first));
        worst = m > worst ? m : worst;
        at = stop;
    }
    return worst < INF_BITS;
}

/* ---------------------------------------------------------------------------------------------
 * sum and decode
 */

/* out = sum of count payloads, chunk by chunk so the running sum stays in L1. Unsigned adds:
   two's complement wrap-around, like torch's int32 +=, without C's signed-overflow UB. */
UNUSED MULTIVERSION static void bfp_sum(const uint32_t *const *payloads, size_t count,
                                        size_t n, uint32_t *restrict out) {
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

/* The sums of coordinates [first, first + n) (values[0, n)) into out[first, first + n), out
   indexed like bfp_encode's x: float(sum) / contributors, one rounding, then times 2**-shift,
   exact (the average, not the sum, is what must fit a float), so a sum decodes to the same bits
   whatever count its neighbours have (chunks of different quorums: bfp.py's decode_counted).
   Dividing by a power of two is multiplying by its exact inverse, and multiplying by two powers
   of two is multiplying by their product: one multiplication a lane where the count allows. */
UNUSED MULTIVERSION static void bfp_decode(const int32_t *restrict values, size_t first,
                                           size_t n, size_t block, const float *restrict shared,
                                           int headroom, int contributors,
                                           float *restrict out) {
    int exact = (contributors & (contributors - 1)) == 0;
    float count = (float)contributors;
    for (size_t at = first, end = first + n; at < end;) {
        size_t b = at / block, stop = MIN(end, (b + 1) * block);
        float scale = power_of_two(-block_shift(shared[b], headroom));
        if (exact) {
            float factor = scale / count; /* a power of two, >= 2**-144: exact */
            for (size_t i = at; i < stop; i++) out[i] = (float)values[i - first] * factor;
        } else {
            for (size_t i = at; i < stop; i++) out[i] = (float)values[i - first] / count * scale;
        }
        at = stop;
    }
}

#endif
