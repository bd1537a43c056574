/* Native CPU kernels for THC's hot loops; native.py is the Python side and torch the fallback.

Entry points take raw addresses (tensor.data_ptr()) that native.py has checked: CPU, contiguous,
the right dtype and size. They release the GIL, so worker threads overlap.

  fwht        in-place Walsh-Hadamard transform of every block, times a scale
  encode      [rotate:] signs, FWHT; then u = clamp(a*y + c, 0, g), unbiased stochastic rounding
              to a table index, b-bit packing (b in 1, 2, 4, 8)
  lookup_sum  the aggregator: table lookup of packed indices, integer sum, packing of the sums
  decode      unpacking of sums, y = a*S + c, [rotate back:] FWHT, signs
  scale_pieces  each tensor's piece of a partition divided or multiplied by its own scale
  piece_squares  each piece's sum of squares (the tensor scales' norms), in a defined order
  accumulate  error feedback's x + e, with the sums of squares of x, e and each piece of x + e
  residual_pieces  error feedback's x - own * scale, piece by piece

Packed layout is bits.py's: element j at bits [j*w, (j+1)*w) of a little-endian bit stream.

Portability: plain C with GCC/Clang vector extensions, which compile to SSE2 anywhere on x86-64;
the hot functions also get an AVX2 clone picked at load time (no -march flags). The nibble table
lookup uses AVX2 intrinsics behind a runtime CPU check, with a scalar loop otherwise; so do the
4-bit rounding and the decode's dequantization of sums up to 8 bits, in loops compiled for
x86-64-v3 alone (``v3(False)`` switches them off, for tests to compare). Where the
CPU has AVX-512 (F, BW, DQ, VL), the transform passes, the rounding and (with VBMI) the decode's
unpacking run sixteen floats wide instead, in functions compiled for x86-64-v4 alone; they give
the eight-wide code's bits (``wide(False)`` switches them off, for tests to compare).
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "lanes_api.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the packed wire layout is read and written as little-endian words"
#endif

#if defined(__x86_64__)
#include <immintrin.h>
#if defined(__has_attribute)
#if __has_attribute(target_clones)
#define MULTIVERSION __attribute__((target_clones("arch=x86-64-v3", "default")))
#endif
#endif
#endif
#ifndef MULTIVERSION
#define MULTIVERSION
#endif

#define INLINE static inline __attribute__((always_inline))
#define MIN(a, b) ((a) < (b) ? (a) : (b))

/* Code for x86-64-v3 (AVX2, FMA, BMI2) alone, run where the CPU has it. */
#if defined(__x86_64__)
#define HAVE_V3 1
#define V3_INLINE static inline __attribute__((always_inline, target("arch=x86-64-v3")))
#define V3 static __attribute__((target("arch=x86-64-v3")))
static int have_v3; /* set at load time */
static int use_v3;  /* the x86-64-v3 paths run: have_v3 unless switched off (``v3(False)``) */
#else
#define HAVE_V3 0
static const int have_v3 = 0, use_v3 = 0;
#endif

/* Orders a kernel's streaming stores before whatever reads their values next. */
INLINE void store_fence(void) {
#if defined(__x86_64__)
    _mm_sfence();
#endif
}

typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint8_t u8x8 __attribute__((vector_size(8)));

#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define SHUFFLE(v, ...) __builtin_shuffle(v, (i32x8){__VA_ARGS__})
#endif

enum {
    LANES = 8,          /* floats per vector */
    LEAF = 4096,        /* coordinates transformed in L1 (16 KiB) */
    CHUNK = 1 << 17,    /* coordinates transformed in L2 (512 KiB) */
    RADIX_LOG = 3,      /* 8 vectors per butterfly column: 16 registers hold them and temporaries */
};

INLINE f32x8 load(const float *p) {
    f32x8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE void store(float *p, f32x8 v) { memcpy(p, &v, sizeof v); }

INLINE i32x8 load_i32(const int32_t *p) {
    i32x8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* ---------------------------------------------------------------------------------------------
 * Walsh-Hadamard transform. The stages of a FWHT commute, so they are grouped by cache level:
 * strides across L2-sized chunks (streaming passes), strides across L1-sized leaves inside a
 * chunk, and the rest inside a leaf. A pass loads each column of up to 8 vectors once and does
 * up to 3 stages on it in registers (16 vectors would not leave the compiler room and spill).
 *
 * The encode runs the groups largest stride first and quantizes each leaf as soon as it is
 * final; its first pass reads the gradient itself, applying scale and rotation signs as it loads
 * (a `source`). The decode runs them smallest stride first: each leaf is dequantized straight
 * into L1 and transformed there, and the last pass applies the signs as it stores. Either way no
 * pass over the whole vector is spent on anything but butterflies.
 */

/* Rotation signs travel as bits (set = negative), a 32nd of the float vector's traffic. */
INLINE f32x8 apply_signs(f32x8 v, uint8_t bits) {
    i32x8 negative = (((i32x8){0} + bits) & (i32x8){1, 2, 4, 8, 16, 32, 64, 128}) != 0;
    return (f32x8)((i32x8)v ^ (negative & INT32_MIN));
}

/* What a transform's first pass reads instead of x: scale * src * signs, zero from `length` on
   (the rotation's padding); with pieces, (src * factors[p]) * scale over each piece p of src
   (the tensor scales as the load reads them: no divided copy of the gradient; the encode's
   factors are its scale over each piece's divisor, a multiplication where a division would
   take a vector divide, several times the pass's other work, and scale 1). */
struct source {
    const float *src;
    size_t length;
    float scale;
    const uint8_t *signs;
    const int64_t *ends; /* the pieces' ends, increasing, the last `length` */
    const float *factors;
    size_t pieces; /* 0: no factors */
};

/* The factors of coordinates i..i+7 (those past the last piece: 1). `cursor`: a piece at or
   before i's; a pass reads each column's coordinates in increasing order, so it keeps one per
   column and finds the piece in a compare or two, not a search. */
INLINE f32x8 piece_factors(const struct source *in, size_t i, size_t *cursor) {
    size_t c = *cursor;
    while (c < in->pieces && (size_t)in->ends[c] <= i) c++;
    *cursor = c;
    if (c < in->pieces && (size_t)in->ends[c] >= i + LANES) return (f32x8){0} + in->factors[c];
    f32x8 d;
    for (int lane = 0; lane < LANES; lane++) {
        while (c < in->pieces && (size_t)in->ends[c] <= i + lane) c++;
        d[lane] = c < in->pieces ? in->factors[c] : 1.0f;
    }
    return d;
}

/* Coordinates i..i+7 of the source; `finite` stays zero unless one of them is an Inf or NaN.
   `pieces`: whether the source has pieces, a compile-time constant in each pass variant. The
   tail is read lane by lane, not copied through memory: a call to memcpy in the loop would
   keep the whole column on the stack. */
INLINE f32x8 source_load(const struct source *in, size_t i, f32x8 *finite, size_t *cursor,
                         int pieces) {
    f32x8 v;
    if (__builtin_expect(i + LANES <= in->length, 1)) { /* laid out inline: the tail is rare */
        v = load(in->src + i);
    } else {
        v = (f32x8){0};
        for (int lane = 0; lane < LANES; lane++)
            if (i + lane < in->length) v[lane] = in->src[i + lane];
    }
    if (pieces) v *= piece_factors(in, i, cursor);
    *finite += v - v;
    return apply_signs(v * in->scale, in->signs[i / LANES]);
}

/* Strides 1, 2 and 4 inside a vector: lane i becomes partner + v[i] (bit clear) or
   partner - v[i] (bit set), the same sums as the scalar butterfly. */
INLINE f32x8 lane_stages(f32x8 v) {
    v = SHUFFLE(v, 1, 0, 3, 2, 5, 4, 7, 6) + v * (f32x8){1, -1, 1, -1, 1, -1, 1, -1};
    v = SHUFFLE(v, 2, 3, 0, 1, 6, 7, 4, 5) + v * (f32x8){1, 1, -1, -1, 1, 1, -1, -1};
    return SHUFFLE(v, 4, 5, 6, 7, 0, 1, 2, 3) + v * (f32x8){1, 1, 1, 1, -1, -1, -1, -1};
}

static volatile float opaque_minus_one = -1;
static volatile float opaque_one = 1; /* see product_plus */

/* a - b is computed as a + b * -1, which the compiler cannot fold back into a subtraction
   (the -1 is opaque to it): with FMA the differences run on the multiply-add pipes while the
   sums run on the add pipes, so a butterfly issues in one cycle instead of two. */
INLINE void butterflies(f32x8 *v, int log_count, f32x8 minus_one) {
    for (int d = 1; d < 1 << log_count; d <<= 1)
        for (int m = 0; m < 1 << log_count; m++)
            if (!(m & d)) {
                f32x8 a = v[m], b = v[m + d];
                v[m] = a + b;
                v[m + d] = a + b * minus_one;
            }
}

/* The stages of strides h, 2h, ..., h << (k - 1) on every span of h << k coordinates of
   x[from, from + n) (h a multiple of LANES), plus the in-vector stages when `lanes` is set (then
   h == LANES). Loads come from `in` if given; stores apply `out_signs` if given. */
INLINE void radix_pass(float *x, size_t from, size_t n, size_t h, int k, int lanes, int pieces,
                       const struct source *source, f32x8 *finite, const uint8_t *out_signs) {
    f32x8 clean = {0}, minus_one = (f32x8){0} + opaque_minus_one;
    /* the source in locals: the stores to x could alias its fields (a float scale among
       them), so read through the pointer they would be read again after every store */
    struct source local = source ? *source : (struct source){0};
    const struct source *in = source ? &local : NULL;
    size_t cursor[1 << RADIX_LOG] = {0}; /* each column's piece (see piece_factors) */
    for (size_t base = from; base < from + n; base += h << k)
        for (size_t j = base; j < base + h; j += LANES) {
            f32x8 v[1 << RADIX_LOG];
#pragma GCC unroll 8
            for (int m = 0; m < 1 << k; m++)
                v[m] = in ? source_load(in, j + m * h, &clean, &cursor[m], pieces)
                          : load(x + j + m * h);
            if (lanes)
#pragma GCC unroll 8
                for (int m = 0; m < 1 << k; m++) v[m] = lane_stages(v[m]);
            butterflies(v, k, minus_one);
#pragma GCC unroll 8
            for (int m = 0; m < 1 << k; m++)
                store(x + j + m * h,
                      out_signs ? apply_signs(v[m], out_signs[(j + m * h) / LANES]) : v[m]);
        }
    if (in) *finite += clean;
}

/* Dispatch to a pass with a compile-time radix, source/sink and in-vector stages, so its
   column stays in registers and the plain pass carries no branches (with `lanes` a run-time
   flag, GCC merges the two paths through the column kept on the stack: eight stores and eight
   loads more a column). */
#define RADIX_PASS_SIDES(k, lanes)                                                               \
    do {                                                                                         \
        if (in && in->pieces)                                                                    \
            radix_pass(x, from, n, h, k, lanes, 1, in, finite, NULL);                            \
        else if (in)                                                                             \
            radix_pass(x, from, n, h, k, lanes, 0, in, finite, NULL);                            \
        else if (out_signs)                                                                      \
            radix_pass(x, from, n, h, k, lanes, 0, NULL, NULL, out_signs);                       \
        else                                                                                     \
            radix_pass(x, from, n, h, k, lanes, 0, NULL, NULL, NULL);                            \
    } while (0)

#define RADIX_PASS_VARIANTS(k)                                                                   \
    do {                                                                                         \
        if (lanes)                                                                               \
            RADIX_PASS_SIDES(k, 1);                                                              \
        else                                                                                     \
            RADIX_PASS_SIDES(k, 0);                                                              \
    } while (0)

MULTIVERSION static void pass(float *x, size_t from, size_t n, size_t h, int k, int lanes,
                              const struct source *in, f32x8 *finite, const uint8_t *out_signs) {
    switch (k) {
    case 0: RADIX_PASS_VARIANTS(0); break;
    case 1: RADIX_PASS_VARIANTS(1); break;
    case 2: RADIX_PASS_VARIANTS(2); break;
    default: RADIX_PASS_VARIANTS(RADIX_LOG); break;
    }
}

/* Where a transform's last pass puts its values instead of back into x: dst[p] = v * factor
   (the tensor scales' multiplication of a decode) or minuend[p] - v * factor (error feedback's
   residual), each rounded as torch's elementwise operations round it, for p < length (the
   padding beyond is dropped); the factor is that of p's piece (ends and factors, in a source's
   ends, factors and pieces), or none without pieces. dst may be x. */
struct sink {
    float *dst;
    size_t length;
    const float *minuend;
    struct source pieces;
    /* whole vectors stored past the caches (wide passes, dst 64-byte aligned): error
       feedback's memory, read again a round later, so no line of it is read before it is
       written (a plain store's miss reads the line first) */
    int stream;
};

/* The sink's values from a finished transform x, in a pass of their own (where the last pass
   cannot write them as it stores). */
static void sink_apply(const struct sink *sink, const float *x) {
    float one = opaque_one;
    const float *minuend = sink->minuend;
    size_t count = sink->pieces.pieces ? sink->pieces.pieces : 1, at = 0;
    for (size_t p = 0; p < count; p++) {
        size_t end = sink->pieces.pieces ? (size_t)sink->pieces.ends[p] : sink->length;
        end = MIN(end, sink->length);
        if (!sink->pieces.pieces) {
            for (size_t i = at; i < end; i++) sink->dst[i] = minuend ? minuend[i] - x[i] : x[i];
        } else {
            float f = sink->pieces.factors[p];
            for (size_t i = at; i < end; i++) {
                float scaled = x[i] * f;
                sink->dst[i] = minuend ? minuend[i] - scaled * one : scaled;
            }
        }
        at = end;
    }
}

/* ---------------------------------------------------------------------------------------------
 * The same passes sixteen floats wide, for CPUs with AVX-512 (picked at load time; x86-64-v4
 * code is only compiled into these functions). The stages run in the same order as the
 * eight-wide passes' (1, 2, 4, 8 in a vector, then the strides upward within each group), each
 * butterfly the same a + b and a - b, so both give the same bits; the 32 vector registers hold
 * a column of 16 vectors, four stages a pass inside a leaf.
 */
#if defined(__x86_64__) && (defined(__clang__) || __GNUC__ >= 11)
#define HAVE_WIDE 1
#define WIDE_TARGET "arch=x86-64-v4"
#define WIDE_INLINE static inline __attribute__((always_inline, target(WIDE_TARGET)))
#define WIDE static __attribute__((target(WIDE_TARGET)))

enum { WLANES = 16, WRADIX_LOG = 4 };

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE16(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define SHUFFLE16(v, ...) __builtin_shuffle(v, (i32x16){__VA_ARGS__})
#endif

static int use_wide; /* set at load time where the CPU has AVX-512 (F, BW, DQ, VL) */

WIDE_INLINE f32x16 load16(const float *p) {
    f32x16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

WIDE_INLINE void store16(float *p, f32x16 v) { memcpy(p, &v, sizeof v); }

/* signs_at: the sign bits of the 16 coordinates (two bytes of the bit stream) */
WIDE_INLINE f32x16 apply_signs16(f32x16 v, const uint8_t *signs_at) {
    uint16_t bits;
    memcpy(&bits, signs_at, sizeof bits);
    return (f32x16)_mm512_mask_xor_epi32((__m512i)v, (__mmask16)bits, (__m512i)v,
                                         _mm512_set1_epi32(INT32_MIN));
}

/* A column's place among the pieces: `c` a piece at or before its coordinates, and the factor
   of whole vectors below `until` (those inside piece c: a compare a vector, no loads). */
struct piece_run {
    size_t c, until;
    f32x16 factor;
};

/* The factors of coordinates i..i+15 (those past the last piece: 1). A pass reads each
   column's coordinates in increasing order, so it keeps a run per column and finds the piece
   in a compare or two, not a search. */
WIDE_INLINE f32x16 piece_factors16(const struct source *in, size_t i, struct piece_run *run) {
    if (__builtin_expect(i + WLANES <= run->until, 1)) return run->factor;
    size_t c = run->c;
    while (c < in->pieces && (size_t)in->ends[c] <= i) c++;
    run->c = c;
    if (c < in->pieces && (size_t)in->ends[c] >= i + WLANES) {
        run->until = (size_t)in->ends[c];
        run->factor = (f32x16){0} + in->factors[c];
        return run->factor;
    }
    f32x16 d;
    for (int lane = 0; lane < WLANES; lane++) {
        while (c < in->pieces && (size_t)in->ends[c] <= i + lane) c++;
        d[lane] = c < in->pieces ? in->factors[c] : 1.0f;
    }
    return d;
}

/* `pieces`: whether the source has pieces, a compile-time constant in each pass variant. The
   tail is a masked load, not a copy through memory: a call to memcpy in the loop would keep the
   whole column on the stack. */
WIDE_INLINE f32x16 source_load16(const struct source *in, size_t i, f32x16 *finite,
                                 struct piece_run *run, int pieces) {
    f32x16 v;
    if (__builtin_expect(i + WLANES <= in->length, 1)) {
        v = load16(in->src + i);
    } else {
        size_t count = i < in->length ? in->length - i : 0; /* < WLANES */
        v = (f32x16)_mm512_maskz_loadu_ps((__mmask16)((1u << count) - 1), in->src + i);
    }
    if (pieces) v *= piece_factors16(in, i, run);
    *finite += v - v;
    return apply_signs16(v * in->scale, in->signs + i / 8);
}

WIDE_INLINE f32x16 lane_stages16(f32x16 v) {
    v = SHUFFLE16(v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14) +
        v * (f32x16){1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1};
    v = SHUFFLE16(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13) +
        v * (f32x16){1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1};
    v = SHUFFLE16(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11) +
        v * (f32x16){1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1};
    return SHUFFLE16(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7) +
           v * (f32x16){1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1};
}

WIDE_INLINE void butterflies16(f32x16 *v, int log_count, f32x16 minus_one) {
#pragma GCC unroll 4
    for (int d = 1; d < 1 << log_count; d <<= 1)
#pragma GCC unroll 16
        for (int m = 0; m < 1 << log_count; m++)
            if (!(m & d)) {
                f32x16 a = v[m], b = v[m + d];
                v[m] = a + b;
                v[m + d] = a + b * minus_one;
            }
}

/* The sink's values of coordinates p.. (v: their final values) */
WIDE_INLINE void sink_store16(const struct sink *sink, size_t p, f32x16 v, struct piece_run *run) {
    if (p + WLANES <= sink->length) { /* whole vectors, no masked loads and stores */
        f32x16 r = v;
        if (sink->pieces.pieces) r = v * piece_factors16(&sink->pieces, p, run);
        if (sink->minuend) {
            f32x16 m = load16(sink->minuend + p), one = (f32x16){0} + opaque_one;
            r = sink->pieces.pieces ? m - r * one : m - v;
        }
        if (sink->stream)
            _mm512_stream_ps(sink->dst + p, (__m512)r);
        else
            store16(sink->dst + p, r);
        return;
    }
    if (p >= sink->length) return;
    size_t count = MIN((size_t)WLANES, sink->length - p);
    __mmask16 keep = count == WLANES ? 0xFFFF : (__mmask16)((1u << count) - 1);
    f32x16 r = v;
    if (sink->pieces.pieces) r = v * piece_factors16(&sink->pieces, p, run);
    if (sink->minuend) {
        f32x16 m = (f32x16)_mm512_maskz_loadu_ps(keep, sink->minuend + p);
        f32x16 one = (f32x16){0} + opaque_one;
        r = sink->pieces.pieces ? m - r * one : m - v;
    }
    _mm512_mask_storeu_ps(sink->dst + p, keep, (__m512)r);
}

WIDE_INLINE void radix_pass16(float *x, size_t from, size_t n, size_t h, int k, int lanes,
                              int pieces, const struct source *source, f32x8 *finite,
                              const uint8_t *out_signs, const struct sink *sink) {
    f32x16 clean = {0}, minus_one = (f32x16){0} + opaque_minus_one;
    /* the source in locals, as radix_pass keeps it: read through the pointer, its fields would
       be read again after every store to x, which could alias them */
    struct source local = source ? *source : (struct source){0};
    const struct source *in = source ? &local : NULL;
    struct piece_run runs[1 << WRADIX_LOG] = {0}; /* each column's (see piece_factors16) */
    for (size_t base = from; base < from + n; base += h << k)
        for (size_t j = base; j < base + h; j += WLANES) {
            f32x16 v[1 << WRADIX_LOG];
#pragma GCC unroll 16
            for (int m = 0; m < 1 << k; m++)
                v[m] = in ? source_load16(in, j + m * h, &clean, &runs[m], pieces)
                          : load16(x + j + m * h);
            if (lanes)
#pragma GCC unroll 16
                for (int m = 0; m < 1 << k; m++) v[m] = lane_stages16(v[m]);
            butterflies16(v, k, minus_one);
#pragma GCC unroll 16
            for (int m = 0; m < 1 << k; m++) {
                f32x16 out = out_signs ? apply_signs16(v[m], out_signs + (j + m * h) / 8) : v[m];
                if (sink)
                    sink_store16(sink, j + m * h, out, &runs[m]);
                else
                    store16(x + j + m * h, out);
            }
        }
    if (in) {
        f32x8 low, high;
        memcpy(&low, &clean, sizeof low);
        memcpy(&high, (const char *)&clean + sizeof low, sizeof high);
        *finite += low + high; /* NaN where either half has one */
    }
}

/* A compile-time radix, source/sink and in-vector stages, as for the eight-wide passes. */
#define RADIX_PASS16_SIDES(k, lanes)                                                             \
    do {                                                                                         \
        if (in && in->pieces)                                                                    \
            radix_pass16(x, from, n, h, k, lanes, 1, in, finite, NULL, NULL);                    \
        else if (in)                                                                             \
            radix_pass16(x, from, n, h, k, lanes, 0, in, finite, NULL, NULL);                    \
        else if (sink)                                                                           \
            radix_pass16(x, from, n, h, k, lanes, 0, NULL, NULL, out_signs, sink);               \
        else if (out_signs)                                                                      \
            radix_pass16(x, from, n, h, k, lanes, 0, NULL, NULL, out_signs, NULL);               \
        else                                                                                     \
            radix_pass16(x, from, n, h, k, lanes, 0, NULL, NULL, NULL, NULL);                    \
    } while (0)

#define RADIX_PASS16_VARIANTS(k)                                                                 \
    do {                                                                                         \
        if (lanes)                                                                               \
            RADIX_PASS16_SIDES(k, 1);                                                            \
        else                                                                                     \
            RADIX_PASS16_SIDES(k, 0);                                                            \
    } while (0)

WIDE void pass16(float *x, size_t from, size_t n, size_t h, int k, int lanes,
                 const struct source *in, f32x8 *finite, const uint8_t *out_signs,
                 const struct sink *sink) {
    switch (k) {
    case 0: RADIX_PASS16_VARIANTS(0); break;
    case 1: RADIX_PASS16_VARIANTS(1); break;
    case 2: RADIX_PASS16_VARIANTS(2); break;
    case 3: RADIX_PASS16_VARIANTS(3); break;
    default: RADIX_PASS16_VARIANTS(WRADIX_LOG); break;
    }
}
#else
#define HAVE_WIDE 0
enum { WLANES = 16, WRADIX_LOG = 4 };
static const int use_wide = 0;
#define quantize_leaf16 quantize_leaf
static void pass16(float *x, size_t from, size_t n, size_t h, int k, int lanes,
                   const struct source *in, f32x8 *finite, const uint8_t *out_signs,
                   const struct sink *sink) {
    (void)x, (void)from, (void)n, (void)h, (void)k, (void)lanes, (void)in, (void)finite;
    (void)out_signs, (void)sink;
}
#endif

static int log2_of(size_t n) { return 63 - __builtin_clzll((unsigned long long)n); }

/* How the stages of a group are run: the first pass reads `in`, the last stores `out_signs`
   (into `sink` if given: wide passes only). */
struct pass_ends {
    const struct source *in;
    f32x8 *finite;
    const uint8_t *out_signs;
    const struct sink *sink;
};

static const struct pass_ends PLAIN = {NULL, NULL, NULL, NULL};

/* All stages of strides stride, 2 stride, ..., block / 2 on every block of x[from, from + n).
   `wide`: sixteen-float passes (block >= WLANES), radix 16 inside a leaf (in L1) and 8 on
   longer strides (16 columns a leaf apart would share L1 sets). */
static void strided_stages(float *x, size_t from, size_t n, size_t block, size_t stride,
                           struct pass_ends ends, int wide) {
    for (size_t h = stride; h < block;) {
        int radix = wide && h < LEAF ? WRADIX_LOG : RADIX_LOG;
        int k = MIN(radix, log2_of(block / h));
        int last = h << k >= block;
        if (wide)
            pass16(x, from, n, h, k, 0, ends.in, ends.finite, last ? ends.out_signs : NULL,
                   last ? ends.sink : NULL);
        else
            pass(x, from, n, h, k, 0, ends.in, ends.finite, last ? ends.out_signs : NULL);
        ends.in = NULL;
        h <<= k;
    }
}

/* All stages of every block (LANES <= block <= LEAF) of a leaf x[from, from + n), n <= LEAF. */
static void leaf_stages(float *x, size_t from, size_t n, size_t block, struct pass_ends ends,
                        int wide) {
    size_t lanes = wide ? WLANES : LANES;
    int k = MIN(wide ? WRADIX_LOG : RADIX_LOG, log2_of(block / lanes));
    int last = lanes << k >= block;
    if (wide)
        pass16(x, from, n, lanes, k, 1, ends.in, ends.finite, last ? ends.out_signs : NULL,
               last ? ends.sink : NULL);
    else
        pass(x, from, n, lanes, k, 1, ends.in, ends.finite, last ? ends.out_signs : NULL);
    ends.in = NULL;
    strided_stages(x, from, n, block, lanes << k, ends, wide);
}

typedef void (*leaf_visitor)(void *state, float *leaf, size_t offset, size_t count);

/* Unnormalised FWHT of every block of x[0, n) (n a multiple of block, block >= LANES a power of
   two), largest strides first; with a source, x is first filled from it (returns 0, and stops
   before visiting anything, where the source holds an Inf or NaN). visit(state, leaf, offset,
   count) sees each leaf once its values are final. */
static int fwht_forward(float *x, size_t n, size_t block, const struct source *in,
                        leaf_visitor visit, void *state) {
    f32x8 finite = {0};
    struct pass_ends first = {in, &finite, NULL, NULL};
    int wide = use_wide && block >= WLANES;
    if (block > CHUNK) {
        strided_stages(x, 0, n, block, CHUNK, first, wide);
        first = PLAIN;
    }
    for (size_t c = 0; c < n; c += CHUNK) {
        size_t chunk = MIN(CHUNK, n - c);
        struct pass_ends ends = first;
        if (MIN(block, CHUNK) > LEAF) {
            strided_stages(x, c, chunk, MIN(block, CHUNK), LEAF, ends, wide);
            ends = PLAIN;
        }
        for (size_t l = c; l < c + chunk; l += LEAF) {
            size_t count = MIN(LEAF, c + chunk - l);
            leaf_stages(x, l, count, MIN(block, LEAF), ends, wide);
            if (in) {
                i32x8 clean = finite == finite;
                for (int lane = 0; lane < LANES; lane++)
                    if (!clean[lane]) return 0;
            }
            visit(state, x + l, l, count);
        }
    }
    return 1;
}

/* The same transform, smallest strides first: produce(state, leaf, offset, count) fills each
   leaf, and the signs multiply the final values as they are stored (into `sink` if given). */
static void fwht_reverse(float *x, size_t n, size_t block, leaf_visitor produce, void *state,
                         const uint8_t *signs, const struct sink *sink) {
    int wide = use_wide && block >= WLANES;
    struct pass_ends last = {NULL, NULL, signs, wide ? sink : NULL};
    for (size_t c = 0; c < n; c += CHUNK) {
        size_t chunk = MIN(CHUNK, n - c);
        for (size_t l = c; l < c + chunk; l += LEAF) {
            size_t count = MIN(LEAF, c + chunk - l);
            produce(state, x + l, l, count);
            leaf_stages(x, l, count, MIN(block, LEAF), block <= LEAF ? last : PLAIN, wide);
        }
        if (MIN(block, CHUNK) > LEAF)
            strided_stages(x, c, chunk, MIN(block, CHUNK), LEAF, block <= CHUNK ? last : PLAIN,
                           wide);
    }
    if (block > CHUNK) strided_stages(x, 0, n, block, CHUNK, last, wide);
    if (sink && !wide) sink_apply(sink, x);
}

MULTIVERSION static void scale_leaf(void *state, float *leaf, size_t offset, size_t count) {
    (void)offset;
    float scale = *(const float *)state;
    for (size_t i = 0; i < count; i++) leaf[i] *= scale;
}

/* ---------------------------------------------------------------------------------------------
 * Bit packing. Eight w-bit values in the bytes (w <= 8) or 16-bit lanes (w <= 16) of 64-bit words
 * are merged pairwise, lane width doubling each step, into the low 8w bits: exactly the w bytes
 * the wire layout has for them. Four words take the steps at once, as one vector; unpacking runs
 * them backwards. A group's word is stored whole where the buffer has room (its high bytes are
 * zero and the next group overwrites them), so only a buffer's last groups are stored bytewise.
 * Value arrays are read and written in whole vectors: callers leave room and zeros up to them.
 */

typedef uint64_t u64x4 __attribute__((vector_size(32)));

/* Each lane of `lane_bits` bits holds the low w bits. */
INLINE uint64_t lanes_mask(int lane_bits, int w) {
    uint64_t unit = lane_bits == 64 ? 1 : ~0ull / ((1ull << lane_bits) - 1);
    return unit * ((1ull << w) - 1);
}

/* Pairs of lanes of `lane_bits` bits, each holding w bits, become one lane holding 2w bits. */
INLINE u64x4 squeeze(u64x4 x, int lane_bits, int w) {
    uint64_t keep = lanes_mask(2 * lane_bits, w);
    return (x & keep) | ((x >> (lane_bits - w)) & (keep << w));
}

INLINE u64x4 unsqueeze(u64x4 x, int lane_bits, int w) {
    uint64_t keep = lanes_mask(2 * lane_bits, w);
    return (x & keep) | ((x << (lane_bits - w)) & (keep << lane_bits));
}

INLINE void put(uint8_t *out, const uint8_t *end, const void *word, ptrdiff_t size) {
    if (end - out >= size)
        memcpy(out, word, (size_t)size);
    else if (out < end)
        memcpy(out, word, (size_t)(end - out));
}

INLINE void get(void *word, ptrdiff_t size, const uint8_t *in, const uint8_t *end) {
    if (end - in >= size) {
        memcpy(word, in, (size_t)size);
    } else {
        memset(word, 0, (size_t)size);
        if (in < end) memcpy(word, in, (size_t)(end - in));
    }
}

/* values[0, count), bytes if w <= 8 and uint16 otherwise, packed in w bits at out. */
MULTIVERSION static void pack(const void *values, size_t count, int w, uint8_t *out,
                              const uint8_t *end) {
    uint64_t words[4];
    u64x4 x;
    for (size_t i = 0; i < count; i += w <= 8 ? 32 : 16) {
        if (w <= 8) {
            memcpy(&x, (const uint8_t *)values + i, sizeof x);
            x = squeeze(squeeze(squeeze(x, 8, w), 16, 2 * w), 32, 4 * w);
            memcpy(words, &x, sizeof words);
            for (int g = 0; g < 4; g++, out += w) put(out, end, &words[g], 8);
        } else {
            memcpy(&x, (const uint16_t *)values + i, sizeof x);
            x = squeeze(squeeze(x, 16, w), 32, 2 * w);
            memcpy(words, &x, sizeof words);
            for (int g = 0; g < 2; g++, out += w) {
                unsigned __int128 bits = words[2 * g] | (unsigned __int128)words[2 * g + 1] << (4 * w);
                put(out, end, &bits, 16);
            }
        }
    }
}

/* The w bits (w <= 8) or w bits and the next w bits (w > 8) of the group at in. */
INLINE uint64_t group_word(const uint8_t *in, const uint8_t *end, int w, int second) {
    if (w <= 8) {
        uint64_t word;
        get(&word, 8, in, end);
        return w == 8 ? word : word & ((1ull << 8 * w) - 1);
    }
    unsigned __int128 bits;
    get(&bits, 16, in, end);
    return (uint64_t)(bits >> (second ? 4 * w : 0)) & (w == 16 ? ~0ull : (1ull << 4 * w) - 1);
}

/* The inverse of pack: count values into values (rounded up to 32 bytes or 16 uint16). The
   vector is built in registers: four stores and a wide reload would stall store forwarding. */
MULTIVERSION static void unpack(const uint8_t *in, const uint8_t *end, int w, size_t count,
                                void *values) {
    for (size_t i = 0; i < count; i += w <= 8 ? 32 : 16) {
        u64x4 x;
        if (w <= 8) {
            x = (u64x4){group_word(in, end, w, 0), group_word(in + w, end, w, 0),
                        group_word(in + 2 * w, end, w, 0), group_word(in + 3 * w, end, w, 0)};
            in += 4 * w;
            x = unsqueeze(unsqueeze(unsqueeze(x, 32, 4 * w), 16, 2 * w), 8, w);
            memcpy((uint8_t *)values + i, &x, sizeof x);
        } else {
            x = (u64x4){group_word(in, end, w, 0), group_word(in, end, w, 1),
                        group_word(in + w, end, w, 0), group_word(in + w, end, w, 1)};
            in += 2 * w;
            x = unsqueeze(unsqueeze(x, 32, 2 * w), 16, w);
            memcpy((uint16_t *)values + i, &x, sizeof x);
        }
    }
}

/* ---------------------------------------------------------------------------------------------
 * Worker encode: u = clamp(a*y + c, 0, g) on the grid, then unbiased stochastic rounding to the
 * table. Randomness: xoshiro128+ in sixteen lanes (element i draws from lane i % 16), seeded by
 * splitmix64 from the worker's seed; the top 24 bits of each draw make a uniform in [0, 1), so
 * rounding probabilities are exact to float32 precision. Eight-wide code runs the sixteen lanes
 * as two halves taking turns, AVX-512 code as one vector: the same draws either way.
 */

struct rng8 {
    u32x8 s0, s1, s2, s3;
};

static uint64_t splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static void rng8_seed(struct rng8 *r, uint64_t seed) {
    for (int lane = 0; lane < LANES; lane++) {
        uint64_t a = splitmix64(&seed), b = splitmix64(&seed);
        r->s0[lane] = (uint32_t)a;
        r->s1[lane] = (uint32_t)(a >> 32);
        r->s2[lane] = (uint32_t)b;
        r->s3[lane] = (uint32_t)(b >> 32);
    }
}

/* One xoshiro128+ step of every lane of state `r` (vectors of lanes, eight or sixteen wide):
   `result` gets s0 + s3 of the state before it. Written once so both widths draw alike. */
#define XOSHIRO128P_STEP(r, result)                                                           \
    do {                                                                                      \
        __typeof__((r)->s1) t_ = (r)->s1 << 9;                                                \
        (result) = (r)->s0 + (r)->s3;                                                         \
        (r)->s2 ^= (r)->s0;                                                                   \
        (r)->s3 ^= (r)->s1;                                                                   \
        (r)->s1 ^= (r)->s2;                                                                   \
        (r)->s0 ^= (r)->s3;                                                                   \
        (r)->s2 ^= t_;                                                                        \
        (r)->s3 = ((r)->s3 << 11) | ((r)->s3 >> 21);                                          \
    } while (0)

/* Eight uniforms in [0, 1), multiples of 2**-24 (xoshiro128+'s low bits are its weak ones). */
INLINE f32x8 rng8_uniform(struct rng8 *r) {
    u32x8 result;
    XOSHIRO128P_STEP(r, result);
    return __builtin_convertvector((i32x8)(result >> 8), f32x8) * 0x1p-24f;
}

/* Sixteen lanes as two halves: lanes 0-7 and 8-15; `next` is the half whose turn it is. */
struct rng16 {
    struct rng8 half[2];
    int next;
};

static void rng16_seed(struct rng16 *r, uint64_t seed) {
    rng8_seed(&r->half[0], seed);
    for (int lane = 0; lane < LANES; lane++) splitmix64(&seed), splitmix64(&seed);
    rng8_seed(&r->half[1], seed); /* the splitmix64 stream's next sixteen values */
    r->next = 0;
}

/* The uniforms of the next eight coordinates: the half whose turn it is. */
INLINE f32x8 rng16_uniform8(struct rng16 *r) {
    f32x8 u = r->next ? rng8_uniform(&r->half[1]) : rng8_uniform(&r->half[0]);
    r->next ^= 1;
    return u;
}

INLINE f32x8 blend(i32x8 mask, f32x8 a, f32x8 b) {
    return (f32x8)((mask & (i32x8)a) | (~mask & (i32x8)b));
}

INLINE i32x8 blend_i(i32x8 mask, i32x8 a, i32x8 b) { return (mask & a) | (~mask & b); }

enum { SMALL_GRID = 32 }; /* cell tables that fit four vectors */

struct grid {
    float a, c, g;
    int small; /* whether the g + 1 cell entries fit `table` */
    /* per unit cell [i, i + 1) for i in 0..g: its table interval k | T[k] << 8 |
       (T[k + 1] - T[k]) << 20; cell g (u == g exactly) repeats cell g - 1 */
    const uint32_t *cells;
    u32x8 table[SMALL_GRID / LANES]; /* the same, in registers, when small */
};

static void grid_init(struct grid *grid, int g, const uint32_t *cells) {
    grid->g = (float)g;
    grid->cells = cells;
    memset(grid->table, 0, sizeof grid->table);
#if defined(__GNUC__) && !defined(__clang__) /* a variable permute (vpermd): GCC only */
    grid->small = g + 1 <= SMALL_GRID;
#else
    grid->small = 0;
#endif
    if (grid->small) memcpy(grid->table, cells, sizeof(uint32_t) * (size_t)(g + 1));
}

/* `small` is a compile-time constant at every call, so each loop has one lookup and no branch. */
INLINE u32x8 cell_entries(const struct grid *grid, i32x8 cell, int small) {
    u32x8 entry = {0};
#if defined(__GNUC__) && !defined(__clang__)
    if (small) {
        /* a permute of each part by the cell's low three bits, then two selections by bits 3
           and 4 (a blend by each lane's sign): nine operations where masking every part with
           a compare takes seventeen */
        u32x8 part[SMALL_GRID / LANES];
        for (int k = 0; k < SMALL_GRID / LANES; k++)
            part[k] = __builtin_shuffle(grid->table[k], (u32x8)cell);
        i32x8 bit3 = cell << 28 >> 31, bit4 = cell << 27 >> 31;
        u32x8 low = (u32x8)blend_i(bit3, (i32x8)part[1], (i32x8)part[0]);
        u32x8 high = (u32x8)blend_i(bit3, (i32x8)part[3], (i32x8)part[2]);
        return (u32x8)blend_i(bit4, (i32x8)high, (i32x8)low);
    }
#endif
    for (int lane = 0; lane < LANES; lane++) entry[lane] = grid->cells[cell[lane]];
    return entry;
}

/* u lies in unit cell floor(u), inside table interval k = [low, low + width]: the index is k,
   plus one with probability (u - low) / width, i.e. when draw * width < u - low (a product
   rounded once, like the quotient it replaces, but without a divide in the loop). */
/* Correlated rounding's thresholds (Suresh et al. 2022; ``CodecContext.stratified_uniform``):
   a stratum per coordinate drawn from a stream every worker of the round shares, shifted by the
   worker's rank mod n, plus this worker's private jitter: (stratum + jitter) / n, below 1. */
struct strata {
    struct rng16 shared;
    int n, rank; /* n = 0: independent thresholds */
};

INLINE f32x8 stratified(struct strata *strata, f32x8 jitter) {
    int n = strata->n;
    i32x8 k = __builtin_convertvector(rng16_uniform8(&strata->shared) * (float)n, i32x8);
    k = blend_i(k < n - 1, k, (i32x8){0} + (n - 1)) + strata->rank; /* in [0, 2n - 1) */
    k -= (k >= n) & n;
    f32x8 draw = (__builtin_convertvector(k, f32x8) + jitter) / (float)n;
    f32x8 top = (f32x8){0} + (1.0f - 0x1p-24f);
    return blend(draw < top, draw, top);
}

/* The index of u (on the grid, in the cell whose entry is `entry`) rounded with threshold
   `draw`; with `value`, its table value T[index]. */
INLINE i32x8 round_in_cell(u32x8 entry, f32x8 u, f32x8 draw, f32x8 *value) {
    f32x8 low = __builtin_convertvector((i32x8)(entry >> 8 & 0xFFF), f32x8);
    f32x8 width = __builtin_convertvector((i32x8)(entry >> 20), f32x8);
    i32x8 up = draw * width < u - low; /* -1 where it rounds up */
    if (value) *value = low + (f32x8)((i32x8)width & up);
    return (i32x8)(entry & 0xFF) - up;
}

/* The index of y's rounding with threshold `draw` (see round_to_table). */
INLINE i32x8 round_drawn(const struct grid *grid, f32x8 y, f32x8 draw, int small, f32x8 *value) {
    f32x8 zero = {0}, g = zero + grid->g;
    f32x8 u = y * grid->a + grid->c;
    u = blend(u > zero, u, zero); /* NaN -> 0 */
    u = blend(u < g, u, g);
    i32x8 cell = __builtin_convertvector(u, i32x8); /* truncation: floor, as u >= 0 */
    return round_in_cell(cell_entries(grid, cell, small), u, draw, value);
}

INLINE i32x8 round_to_table(const struct grid *grid, struct rng16 *rng, f32x8 y, int small,
                            f32x8 *value, struct strata *strata) {
    f32x8 draw = rng16_uniform8(rng);
    if (strata) draw = stratified(strata, draw);
    return round_drawn(grid, y, draw, small, value);
}

struct quantizer {
    struct grid grid;
    struct rng16 rng;
    int bits;
    uint8_t *out, *end;
    /* optional: error feedback's y - reconstruction, the reconstruction of T[index] being
       T[index] * step + offset rounded as torch's mul_ then add_ round it (the decode's step
       and offset: what the payload alone decodes to, in the rotated domain) */
    float *error, step, offset;
    /* optional: y itself is overwritten with what the payload alone decodes to, T[index] *
       own_a + own_c (the decode's dequantization of a one-contributor sum), for error feedback
       to transform back without packing, summing and unpacking the payload */
    int own;
    float own_a, own_c;
    struct strata strata; /* correlated rounding's, where strata.n > 0 */
    int finite; /* cleared by the wide rounding where a value it rounded was an Inf or NaN */
};

/* a * b + c as torch's mul_ then add_ round it, the product rounded on its own: GCC contracts
   a * b + c into a multiply-add in GNU C, so the sum is fed (a * b) * one instead, the one
   opaque to it; a multiply-add of that (p * 1 + c) rounds once, as p + c does. */
INLINE f32x8 product_plus(f32x8 a, f32x8 b, f32x8 c, f32x8 one) { return (a * b) * one + c; }

/* indices[0, count) of y[0, count), count a multiple of LANES; with `error`, also
   error[i] = y[i] - (T[index] * step + offset), each operation rounded to float32 as torch's
   elementwise operations round it; with `own`, y[i] = T[index] * own_a + own_c */
INLINE void round_all(const struct grid *grid, struct rng16 *rng, float *y, size_t count,
                      int32_t *indices, int small, float *error, float step, float offset,
                      struct strata *strata, int own, float own_a, float own_c) {
    f32x8 step_v = (f32x8){0} + step, offset_v = (f32x8){0} + offset;
    f32x8 one = (f32x8){0} + opaque_one;
    for (size_t i = 0; i < count; i += LANES) {
        f32x8 value, v = load(y + i);
        i32x8 index = round_to_table(grid, rng, v, small, error || own ? &value : NULL, strata);
        memcpy(indices + i, &index, sizeof index);
        if (error) store(error + i, v - product_plus(value, step_v, offset_v, one));
        if (own) store(y + i, value * own_a + own_c);
    }
}

#if HAVE_V3
/* round_drawn for a small grid with AVX2's blends: each selection one instruction on the
   sign of its mask (GNU C's vectors make three of an and, andnot and or), and the clamps a
   max and a min, which give what the blends give (NaN and -0 become 0, as max returns its
   second operand where the first is NaN or the two are equal). */
V3_INLINE i32x8 round_drawn_v3(const struct grid *grid, const __m256i *parts, f32x8 y,
                               f32x8 draw, f32x8 *value) {
    f32x8 u = y * grid->a + grid->c;
    u = (f32x8)_mm256_max_ps((__m256)u, _mm256_setzero_ps());
    u = (f32x8)_mm256_min_ps((__m256)u, _mm256_set1_ps(grid->g));
    __m256i cell = _mm256_cvttps_epi32((__m256)u); /* truncation: floor, as u >= 0 */
    /* each part permuted by the cell's low three bits, then chosen by bits 3 and 4 */
    __m256 bit3 = _mm256_castsi256_ps(_mm256_slli_epi32(cell, 28));
    __m256 bit4 = _mm256_castsi256_ps(_mm256_slli_epi32(cell, 27));
    __m256 part[SMALL_GRID / LANES];
    for (int k = 0; k < SMALL_GRID / LANES; k++)
        part[k] = _mm256_castsi256_ps(_mm256_permutevar8x32_epi32(parts[k], cell));
    __m256 low = _mm256_blendv_ps(part[0], part[1], bit3);
    __m256 high = _mm256_blendv_ps(part[2], part[3], bit3);
    u32x8 entry = (u32x8)_mm256_castps_si256(_mm256_blendv_ps(low, high, bit4));
    return round_in_cell(entry, u, draw, value);
}

/* The packed bytes of sixteen 4-bit indices, a (coordinates 0-7) and b (8-15): a 64-bit lane
   of a | b << 8 holds indices 2k and 2k + 1 of each; shifted down 28 bits and merged, its byte
   0 is a's pair and byte 1 b's, and a byte shuffle in each half and a merge of the halves put
   the eight bytes in order. */
V3_INLINE uint64_t nibbles16(i32x8 a, i32x8 b) {
    __m256i c = (__m256i)(a | b << 8);
    c = _mm256_or_si256(c, _mm256_srli_epi64(c, 28));
    c = _mm256_shuffle_epi8(c, _mm256_setr_epi8(0, 8, -1, -1, 1, 9, -1, -1, -1, -1, -1, -1, -1,
                                                -1, -1, -1, -1, -1, 0, 8, -1, -1, 1, 9, -1, -1,
                                                -1, -1, -1, -1, -1, -1));
    __m128i both = _mm_or_si128(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    return (uint64_t)_mm_cvtsi128_si64(both);
}

/* The rounding of a small grid's 4-bit indices with independent thresholds, sixteen
   coordinates a step: the two halves of the generator take their turns in program order (no
   branch on whose turn it is), and the indices are packed in registers straight into `out`
   (no index array, narrowing or packing pass). Starts at half 0; returns the coordinates it
   rounded, a multiple of 16 whose bytes fit before `end`. */
V3_INLINE size_t round_pairs4(const struct grid *grid, struct rng16 *rng, float *y, size_t count,
                              uint8_t *out, const uint8_t *end, float *error, float step,
                              float offset, int own, float own_a, float own_c) {
    size_t room = end > out ? (size_t)(end - out) * 2 : 0;
    size_t done = MIN(count, room) / 16 * 16;
    f32x8 step_v = (f32x8){0} + step, offset_v = (f32x8){0} + offset;
    f32x8 one = (f32x8){0} + opaque_one;
    __m256i parts[SMALL_GRID / LANES];
    memcpy(parts, grid->table, sizeof parts);
    /* error feedback's memory is read again a round later, after the other partitions' work
       has gone through the caches: stored past them, its lines are not read first (a write
       miss reads the line it fills); the caller fences before the memory is read */
    int stream_error = error && (uintptr_t)error % 32 == 0;
    for (size_t i = 0; i < done; i += 16) {
        f32x8 value[2], v[2] = {load(y + i), load(y + i + LANES)};
        i32x8 low = round_drawn_v3(grid, parts, v[0], rng8_uniform(&rng->half[0]),
                                   error || own ? &value[0] : NULL);
        i32x8 high = round_drawn_v3(grid, parts, v[1], rng8_uniform(&rng->half[1]),
                                    error || own ? &value[1] : NULL);
        uint64_t packed = nibbles16(low, high);
        memcpy(out + i / 2, &packed, sizeof packed);
        for (int h = 0; h < 2; h++) {
            f32x8 e = v[h] - product_plus(value[h], step_v, offset_v, one);
            if (error && stream_error)
                _mm256_stream_ps(error + i + h * LANES, (__m256)e);
            else if (error)
                store(error + i + h * LANES, e);
            if (own) store(y + i + h * LANES, value[h] * own_a + own_c);
        }
    }
    return done;
}

/* The coordinates of a leaf that round_pairs4 rounds and packs (0 where it does not apply:
   other widths, large grids, correlated rounding, a leaf starting at the generator's second
   half, or a CPU without AVX2). */
V3 size_t quantize_pairs4(struct quantizer *q, float *y, size_t offset, size_t count) {
    const struct grid grid = q->grid; /* locals: the output's stores could alias the fields */
    struct rng16 rng = q->rng;
    uint8_t *out = q->out + offset / 2;
    float *error = q->error ? q->error + offset : NULL;
    size_t done;
    if (q->own)
        done = round_pairs4(&grid, &rng, y, count, out, q->end, NULL, 0, 0, 1, q->own_a, q->own_c);
    else if (error)
        done = round_pairs4(&grid, &rng, y, count, out, q->end, error, q->step, q->offset, 0, 0,
                            0);
    else
        done = round_pairs4(&grid, &rng, y, count, out, q->end, NULL, 0, 0, 0, 0, 0);
    q->rng = rng;
    return done;
}
#else
static size_t quantize_pairs4(struct quantizer *q, float *y, size_t offset, size_t count) {
    (void)q, (void)y, (void)offset, (void)count;
    return 0;
}
#endif

/* Indices of y[0, count <= LEAF), packed at the place of coordinate `offset` (a multiple of 8). */
MULTIVERSION static void quantize_leaf(void *state, float *y, size_t offset, size_t count) {
    struct quantizer *q = state;
    if (use_v3 && q->bits == 4 && q->grid.small && !q->strata.n && !q->rng.next) {
        size_t done = quantize_pairs4(q, y, offset, count);
        y += done, offset += done, count -= done;
        if (!count) return;
    }
    /* locals, kept in registers: stores to the arrays cannot alias them */
    const struct grid grid = q->grid;
    struct rng16 rng = q->rng;
    struct strata strata = q->strata;
    struct strata *correlated = strata.n ? &strata : NULL;
    int32_t wide[LEAF];
    uint8_t indices[LEAF + 32];
    size_t whole = count / LANES * LANES;
    float *error = q->error ? q->error + offset : NULL;
    int own = q->own;
    float own_a = q->own_a, own_c = q->own_c;
    float step = q->step, shift = q->offset;
    if (correlated)
        round_all(&grid, &rng, y, whole, wide, grid.small, error, step, shift, correlated, own,
                  own_a, own_c);
    else if (grid.small && own)
        round_all(&grid, &rng, y, whole, wide, 1, NULL, 0, 0, NULL, 1, own_a, own_c);
    else if (grid.small && error)
        round_all(&grid, &rng, y, whole, wide, 1, error, step, shift, NULL, 0, 0, 0);
    else if (grid.small)
        round_all(&grid, &rng, y, whole, wide, 1, NULL, 0, 0, NULL, 0, 0, 0);
    else
        round_all(&grid, &rng, y, whole, wide, 0, error, step, shift, NULL, own, own_a, own_c);
    if (whole < count) {
        float tail[LANES] = {0}, tail_error[LANES];
        memcpy(tail, y + whole, (count - whole) * sizeof(float));
        round_all(&grid, &rng, tail, LANES, wide + whole, grid.small, error ? tail_error : NULL,
                  step, shift, correlated, own, own_a, own_c);
        if (error) memcpy(error + whole, tail_error, (count - whole) * sizeof(float));
        if (own) memcpy(y + whole, tail, (count - whole) * sizeof(float));
    }
    q->rng = rng;
    q->strata = strata;
    for (size_t i = 0; i < count; i++) indices[i] = (uint8_t)wide[i];
    memset(indices + count, 0, sizeof indices - count); /* padding packs as zero bits */
    pack(indices, count, q->bits, q->out + offset / 8 * q->bits, q->end);
}

#if HAVE_WIDE
/* The rounding sixteen coordinates at a time (AVX-512), drawing the same uniforms in the same
   order as the eight-wide loop (two draws of the eight-lane generator per vector), so payloads
   are the same bits either way. A grid of up to 32 cells is looked up with one two-table
   permute; indices narrow to bytes in a register, and 4- and 8-bit indices are packed there
   too, straight into the payload. */
/* The sixteen lanes of a struct rng16 in one vector each (lanes 0-7: half 0), its turn at half
   0: one step of it draws the uniforms of sixteen coordinates. */
struct rng16w {
    u32x16 s0, s1, s2, s3;
};

WIDE_INLINE u32x16 concat8u(u32x8 low, u32x8 high) {
    return (u32x16)_mm512_inserti64x4(_mm512_castsi256_si512((__m256i)low), (__m256i)high, 1);
}

WIDE_INLINE struct rng16w rng_widen(const struct rng16 *r) {
    const struct rng8 *a = &r->half[0], *b = &r->half[1];
    return (struct rng16w){concat8u(a->s0, b->s0), concat8u(a->s1, b->s1),
                           concat8u(a->s2, b->s2), concat8u(a->s3, b->s3)};
}

WIDE_INLINE void rng_narrow(struct rng16 *r, const struct rng16w *w) {
    memcpy(&r->half[0].s0, &w->s0, 32), memcpy(&r->half[1].s0, (const char *)&w->s0 + 32, 32);
    memcpy(&r->half[0].s1, &w->s1, 32), memcpy(&r->half[1].s1, (const char *)&w->s1 + 32, 32);
    memcpy(&r->half[0].s2, &w->s2, 32), memcpy(&r->half[1].s2, (const char *)&w->s2 + 32, 32);
    memcpy(&r->half[0].s3, &w->s3, 32), memcpy(&r->half[1].s3, (const char *)&w->s3 + 32, 32);
}

WIDE_INLINE f32x16 rng16w_uniform(struct rng16w *r) {
    u32x16 result;
    XOSHIRO128P_STEP(r, result);
    return __builtin_convertvector((i32x16)(result >> 8), f32x16) * 0x1p-24f;
}

struct strata16 {
    struct rng16w shared;
    int n, rank;
};

WIDE_INLINE f32x16 stratified16(struct strata16 *strata, f32x16 jitter) {
    int n = strata->n;
    i32x16 k = __builtin_convertvector(rng16w_uniform(&strata->shared) * (float)n, i32x16);
    k = (i32x16)_mm512_min_epi32((__m512i)k, _mm512_set1_epi32(n - 1)) + strata->rank;
    k -= (k >= n) & n;
    f32x16 draw = (__builtin_convertvector(k, f32x16) + jitter) / (float)n;
    return (f32x16)_mm512_min_ps((__m512)draw, _mm512_set1_ps(1.0f - 0x1p-24f));
}

WIDE_INLINE i32x16 round_to_table16(const struct grid *grid, __m512i low_cells,
                                    __m512i high_cells, struct rng16w *rng, f32x16 y, int small,
                                    f32x16 *value, struct strata16 *strata) {
    f32x16 u = y * grid->a + grid->c;
    /* max returns its second operand where the first is NaN: NaN -> 0, as the blends do */
    u = (f32x16)_mm512_max_ps((__m512)u, _mm512_setzero_ps());
    u = (f32x16)_mm512_min_ps((__m512)u, _mm512_set1_ps(grid->g));
    i32x16 cell = __builtin_convertvector(u, i32x16); /* truncation: floor, as u >= 0 */
    u32x16 entry;
    if (small)
        entry = (u32x16)_mm512_permutex2var_epi32(low_cells, (__m512i)cell, high_cells);
    else
        entry = (u32x16)_mm512_i32gather_epi32((__m512i)cell, grid->cells, 4);
    f32x16 low = __builtin_convertvector((i32x16)(entry >> 8 & 0xFFF), f32x16);
    f32x16 width = __builtin_convertvector((i32x16)(entry >> 20), f32x16);
    f32x16 draw = rng16w_uniform(rng);
    if (strata) draw = stratified16(strata, draw);
    __mmask16 up = _mm512_cmp_ps_mask((__m512)(draw * width), (__m512)(u - low), _CMP_LT_OQ);
    if (value) /* the table value T[index] */
        *value = (f32x16)_mm512_mask_add_ps((__m512)low, up, (__m512)low, (__m512)width);
    __m512i index = (__m512i)(entry & 0xFF);
    return (i32x16)_mm512_mask_add_epi32(index, up, index, _mm512_set1_epi32(1));
}

/* round_all sixteen wide over y[0, count), count a multiple of 16: index bytes into `indices`,
   and with `packed` (4- or 8-bit indices) the packed bytes of y[0] on there as well */
WIDE_INLINE void round_all16(const struct grid *grid, struct rng16w *rng, float *y, size_t count,
                             uint8_t *indices, uint8_t *packed, int bits, int small,
                             float *error, float step, float offset, struct strata16 *strata,
                             int own, float own_a, float own_c, f32x16 *clean) {
    f32x16 step_v = (f32x16){0} + step, offset_v = (f32x16){0} + offset;
    f32x16 one = (f32x16){0} + opaque_one;
    /* error feedback's memory is read again a round later, after the other partitions' work
       has gone through the caches: stored past them, its lines are not read first (a write
       miss reads the line it fills) */
    int stream_error = error && (uintptr_t)error % 64 == 0;
    __m512i low_cells = _mm512_loadu_si512(&grid->table[0]);
    __m512i high_cells = _mm512_loadu_si512(&grid->table[2]);
    for (size_t i = 0; i < count; i += WLANES) {
        f32x16 value, v = load16(y + i);
        *clean += v - v;
        i32x16 index = round_to_table16(grid, low_cells, high_cells, rng, v, small,
                                        error || own ? &value : NULL, strata);
        if (packed && bits == 4) {
            /* lanes 2j and 2j + 1 in one 64-bit lane: the high index's bits 32.. move to 4.. */
            __m512i pairs = (__m512i)index;
            pairs = _mm512_or_si512(pairs, _mm512_srli_epi64(pairs, 28));
            _mm_storel_epi64((__m128i *)(packed + i / 2), _mm512_cvtepi64_epi8(pairs));
        } else if (packed) {
            _mm_storeu_si128((__m128i *)(packed + i), _mm512_cvtepi32_epi8((__m512i)index));
        } else {
            _mm_storeu_si128((__m128i *)(indices + i), _mm512_cvtepi32_epi8((__m512i)index));
        }
        if (error) {
            f32x16 e = v - ((value * step_v) * one + offset_v);
            if (stream_error)
                _mm512_stream_ps(error + i, (__m512)e);
            else
                store16(error + i, e);
        }
        if (own) store16(y + i, value * own_a + own_c);
    }
}

static void quantize_leaf(void *state, float *y, size_t offset, size_t count);

/* quantize_leaf, sixteen wide; a count that is not a multiple of 16 leaves its last few
   coordinates to the eight-wide loop, which continues the same draws. */
WIDE void quantize_leaf16(void *state, float *y, size_t offset, size_t count) {
    struct quantizer *q = state;
    if (q->rng.next) { /* a leaf after an odd number of eight-coordinate steps (a tail) */
        quantize_leaf(q, y, offset, count);
        return;
    }
    const struct grid grid = q->grid;
    struct rng16w rng = rng_widen(&q->rng);
    struct strata16 strata = {rng_widen(&q->strata.shared), q->strata.n, q->strata.rank};
    struct strata16 *correlated = strata.n ? &strata : NULL;
    uint8_t indices[LEAF + 32];
    f32x16 clean = {0};
    size_t whole = count / WLANES * WLANES;
    int bits = q->bits;
    uint8_t *out = q->out + offset / 8 * bits;
    uint8_t *packed = bits == 4 || bits == 8 ? out : NULL;
    float *error = q->error ? q->error + offset : NULL;
    int own = q->own;
    float own_a = q->own_a, own_c = q->own_c;
    float step = q->step, shift = q->offset;
    if (correlated)
        round_all16(&grid, &rng, y, whole, indices, packed, bits, grid.small, error, step, shift,
                    correlated, own, own_a, own_c, &clean);
    else if (grid.small && own && bits == 4)
        round_all16(&grid, &rng, y, whole, indices, packed, 4, 1, NULL, 0, 0, NULL, 1, own_a,
                    own_c, &clean);
    else if (grid.small && error && bits == 4)
        round_all16(&grid, &rng, y, whole, indices, packed, 4, 1, error, step, shift, NULL, 0, 0,
                    0, &clean);
    else if (grid.small && bits == 4)
        round_all16(&grid, &rng, y, whole, indices, packed, 4, 1, NULL, 0, 0, NULL, 0, 0, 0,
                    &clean);
    else if (grid.small)
        round_all16(&grid, &rng, y, whole, indices, packed, bits, 1, error, step, shift, NULL,
                    own, own_a, own_c, &clean);
    else
        round_all16(&grid, &rng, y, whole, indices, packed, bits, 0, error, step, shift, NULL,
                    own, own_a, own_c, &clean);
    rng_narrow(&q->rng, &rng);
    if (_mm512_cmp_ps_mask((__m512)clean, (__m512)clean, _CMP_UNORD_Q)) q->finite = 0;
    if (correlated) rng_narrow(&q->strata.shared, &strata.shared);
    if (!packed && whole) {
        memset(indices + whole, 0, 32); /* padding packs as zero bits */
        pack(indices, whole, bits, out, q->end);
    }
    if (whole < count) quantize_leaf(q, y + whole, offset + whole, count - whole);
}
#endif

/* Whether y[0, count) holds no Inf or NaN (read into L1 for the rounding that follows). */
MULTIVERSION static int leaf_finite(const float *y, size_t count) {
    f32x8 clean = {0};
    size_t i = 0;
    for (; i + LANES <= count; i += LANES) {
        f32x8 v = load(y + i);
        clean += v - v;
    }
    float rest = 0;
    for (; i < count; i++) rest += y[i] - y[i];
    i32x8 same = clean == clean;
    for (int lane = 0; lane < LANES; lane++)
        if (!same[lane]) return 0;
    return rest == rest;
}

/* The rounding of an unrotated y, leaf by leaf, each checked first; returns 0, and stops, at
   the first leaf that holds an Inf or NaN. */
static int quantize(struct quantizer *q, float *y, size_t n) {
    for (size_t offset = 0; offset < n; offset += LEAF) {
        size_t count = MIN(LEAF, n - offset);
#if HAVE_WIDE
        if (use_wide && !q->rng.next) { /* the wide rounding checks what it reads */
            size_t whole = count / WLANES * WLANES;
            if (whole < count && !leaf_finite(y + offset + whole, count - whole)) return 0;
            q->finite = 1;
            quantize_leaf16(q, y + offset, offset, count);
            if (!q->finite) return 0;
            continue;
        }
#endif
        if (!leaf_finite(y + offset, count)) return 0;
        quantize_leaf(q, y + offset, offset, count);
    }
    return 1;
}

/* ---------------------------------------------------------------------------------------------
 * Worker decode: y = a*S + c from the packed sums S.
 */
struct dequantizer {
    const uint8_t *in, *end;
    int w;
    float a, c;
};

#if HAVE_V3
/* dequantize_leaf's sums of w <= 8 bits read straight from the packed bytes, eight a step:
   sum j of a group starts at bit w * j of the group's w bytes, so each 32-bit lane gathers the
   two bytes it starts in (a byte shuffle of the group's eight bytes), shifts them down and
   masks w bits: no unpacking pass and no byte array. Returns the coordinates done (a multiple
   of 8 whose group's eight-byte load stays before `end`). */
V3 size_t dequantize_v3(const struct dequantizer *d, float *y, size_t offset, size_t count) {
    int w = d->w;
    const uint8_t *in = d->in + offset / 8 * w;
    size_t room = d->end > in ? (size_t)(d->end - in) : 0;
    size_t groups = room < 8 ? 0 : MIN(count / 8, (room - 8) / (size_t)w + 1);
    int8_t select[32];
    int32_t shift[8];
    for (int j = 0; j < 8; j++) {
        int bit = w * j;
        for (int b = 0; b < 4; b++) /* lane j's bytes (each 128-bit half shuffles its own) */
            select[4 * j + b] = (int8_t)(b < 2 ? bit / 8 + b : -1);
        shift[j] = bit % 8;
    }
    __m256i select_v = _mm256_loadu_si256((const __m256i *)select);
    __m256i shift_v = _mm256_loadu_si256((const __m256i *)shift);
    __m256i mask = _mm256_set1_epi32((1 << w) - 1);
    f32x8 a = (f32x8){0} + d->a, c = (f32x8){0} + d->c;
    for (size_t g = 0; g < groups; g++) {
        uint64_t word;
        memcpy(&word, in + g * (size_t)w, sizeof word);
        __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi64x((long long)word), select_v);
        v = _mm256_and_si256(_mm256_srlv_epi32(v, shift_v), mask);
        f32x8 sums = __builtin_convertvector((i32x8)v, f32x8);
        store(y + 8 * g, sums * a + c);
    }
    return groups * 8;
}
#else
static size_t dequantize_v3(const struct dequantizer *d, float *y, size_t offset, size_t count) {
    (void)d, (void)y, (void)offset, (void)count;
    return 0;
}
#endif

/* y[0, count <= LEAF) = a*S + c for the sums S of coordinates offset.. (offset a multiple of 8). */
MULTIVERSION static void dequantize_leaf(void *state, float *y, size_t offset, size_t count) {
    const struct dequantizer *d = state;
    if (use_v3 && d->w <= 8) {
        size_t done = dequantize_v3(d, y, offset, count);
        y += done, offset += done, count -= done;
        if (!count) return;
    }
    union {
        uint8_t narrow[LEAF];
        uint16_t wide[LEAF];
    } sums;
    unpack(d->in + offset / 8 * d->w, d->end, d->w, count, &sums);
    const float a = d->a, c = d->c; /* locals: a store to y could alias the fields */
    if (d->w <= 8)
        for (size_t i = 0; i < count; i++) y[i] = (float)sums.narrow[i] * a + c;
    else
        for (size_t i = 0; i < count; i++) y[i] = (float)sums.wide[i] * a + c;
}

#if HAVE_WIDE
static int have_vbmi; /* AVX-512 VBMI's byte permute, for the decode's unpacking */

typedef uint64_t u64x8 __attribute__((vector_size(64)));

WIDE_INLINE u64x8 unsqueeze8(u64x8 x, int lane_bits, int w) {
    uint64_t keep = lanes_mask(2 * lane_bits, w);
    return (x & keep) | ((x << (lane_bits - w)) & (keep << lane_bits));
}

/* dequantize_leaf for sums of up to 8 bits, 64 at a time: one byte permute puts each group of
   eight sums (w bytes) in a 64-bit lane, unpack's steps widen them to bytes, and each byte
   becomes a*S + c, written as the eight-wide loop writes it (one multiply-add). */
__attribute__((target(WIDE_TARGET ",avx512vbmi"))) static void
dequantize_leaf16(void *state, float *y, size_t offset, size_t count) {
    const struct dequantizer *d = state;
    int w = d->w;
    size_t i = 0;
    if (w <= 8) {
        const uint8_t *in = d->in + offset / 8 * (size_t)w;
        uint8_t order[64];
        for (int b = 0; b < 64; b++) order[b] = (uint8_t)(b / 8 * w + b % 8);
        __m512i gather = _mm512_loadu_si512(order);
        f32x16 a = (f32x16){0} + d->a, c = (f32x16){0} + d->c;
        for (; i + 64 <= count && d->end - in >= 64; i += 64, in += 8 * w) {
            u64x8 x = (u64x8)_mm512_permutexvar_epi8(gather, _mm512_loadu_si512(in));
            x = unsqueeze8(unsqueeze8(unsqueeze8(x, 32, 4 * w), 16, 2 * w), 8, w);
            __m512i bytes = (__m512i)x;
            for (int part = 0; part < 4; part++) {
                __m128i sixteen = _mm512_extracti32x4_epi32(bytes, 0);
                if (part == 1) sixteen = _mm512_extracti32x4_epi32(bytes, 1);
                if (part == 2) sixteen = _mm512_extracti32x4_epi32(bytes, 2);
                if (part == 3) sixteen = _mm512_extracti32x4_epi32(bytes, 3);
                f32x16 s = __builtin_convertvector((i32x16)_mm512_cvtepu8_epi32(sixteen), f32x16);
                store16(y + i + 16 * part, s * a + c);
            }
        }
    }
    if (i < count) dequantize_leaf(state, y + i, offset + i, count - i);
}
#else
#define dequantize_leaf16 dequantize_leaf
static const int have_vbmi = 0;
#endif

/* ---------------------------------------------------------------------------------------------
 * Aggregator: sums of table values of b-bit indices, per L1-sized chunk, accumulated in bytes
 * when the sums fit 8 bits and in 16-bit lanes otherwise, then packed to the sum width.
 */

static int have_avx2;

INLINE void add_lookups(void *acc, int wide, const uint8_t *packed, size_t from, size_t count,
                        int bits, const uint16_t *table) {
    unsigned mask = (1u << bits) - 1;
    for (size_t j = from; j < count; j++) {
        size_t bit = j * bits;
        uint16_t value = table[(packed[bit / 8] >> (bit % 8)) & mask];
        if (wide)
            ((uint16_t *)acc)[j] += value;
        else
            ((uint8_t *)acc)[j] += (uint8_t)value;
    }
}

#if defined(__x86_64__)
/* The table bytes of the 64 four-bit indices packed in 32 bytes, in coordinate order: values[0]
   holds coordinates 0-31, values[1] 32-63 (one vpshufb per nibble half). */
__attribute__((target("avx2"))) static inline void nibble_lookups(const uint8_t *packed,
                                                                  __m256i lut, __m256i *values) {
    __m256i nibble = _mm256_set1_epi8(0x0F);
    __m256i bytes = _mm256_loadu_si256((const __m256i *)packed);
    __m256i even = _mm256_shuffle_epi8(lut, _mm256_and_si256(bytes, nibble));
    __m256i odd = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble));
    __m256i mixed_low = _mm256_unpacklo_epi8(even, odd);  /* coordinates 0-15 | 32-47 */
    __m256i mixed_high = _mm256_unpackhi_epi8(even, odd); /* 16-31 | 48-63 */
    values[0] = _mm256_permute2x128_si256(mixed_low, mixed_high, 0x20);
    values[1] = _mm256_permute2x128_si256(mixed_low, mixed_high, 0x31);
}

/* Four-bit indices, table values below 256: 64 lookups per vpshufb pair. Returns how many
   coordinates it did (a multiple of 64). */
__attribute__((target("avx2"))) static size_t add_nibble_lookups_avx2(void *acc, int wide,
                                                                      const uint8_t *packed,
                                                                      size_t count,
                                                                      const uint8_t *table) {
    __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)table));
    size_t j = 0;
    for (; j + 64 <= count; j += 64) {
        __m256i values[2];
        nibble_lookups(packed + j / 2, lut, values);
        for (int half = 0; half < 2; half++) {
            if (wide) {
                __m256i *sums = (__m256i *)((uint16_t *)acc + j + 32 * half);
                __m256i low = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(values[half]));
                __m256i high = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(values[half], 1));
                _mm256_storeu_si256(sums, _mm256_add_epi16(_mm256_loadu_si256(sums), low));
                _mm256_storeu_si256(sums + 1, _mm256_add_epi16(_mm256_loadu_si256(sums + 1), high));
            } else {
                __m256i *sums = (__m256i *)((uint8_t *)acc + j + 32 * half);
                _mm256_storeu_si256(sums, _mm256_add_epi8(_mm256_loadu_si256(sums), values[half]));
            }
        }
    }
    return j;
}
#endif

MULTIVERSION static void add_payload(void *acc, int wide, const uint8_t *packed, size_t count,
                                     int bits, const uint16_t *table, const uint8_t *nibble_table) {
    size_t done = 0;
#if defined(__x86_64__)
    if (nibble_table && have_avx2) done = add_nibble_lookups_avx2(acc, wide, packed, count, nibble_table);
#endif
    add_lookups(acc, wide, packed, done, count, bits, table);
}

struct lookup_sum {
    const uint8_t *const *payloads;
    size_t payload_count, n;
    int bits, w;
    uint16_t table[256];
    uint8_t nibble_table[16]; /* the table as bytes, where vpshufb can use it */
    int nibble;
    uint8_t *out, *end;
};

static void lookup_sum(const struct lookup_sum *op) {
    int wide = op->w > 8;
    union {
        uint8_t narrow[LEAF];
        uint16_t wide[LEAF];
    } acc;
    for (size_t c = 0; c < op->n; c += LEAF) {
        size_t count = MIN(LEAF, op->n - c);
        memset(&acc, 0, sizeof acc);
        for (size_t p = 0; p < op->payload_count; p++)
            add_payload(&acc, wide, op->payloads[p] + c / 8 * op->bits, count, op->bits, op->table,
                        op->nibble ? op->nibble_table : NULL);
        pack(&acc, count, op->w, op->out + c / 8 * op->w, op->end);
    }
}

/* ---------------------------------------------------------------------------------------------
 * A switch's slot: table values of one arrival's packed indices written into (first arrival) or
 * added to an int32 accumulator, and the accumulator packed to the sum width for the result.
 */

#if defined(__x86_64__)
/* Four-bit indices, table values below 256, into int32 lanes: 64 lookups per vpshufb pair.
   Returns how many lanes it did (a multiple of 64). */
__attribute__((target("avx2"))) static size_t accumulate_nibbles_avx2(int32_t *acc,
                                                                       const uint8_t *packed,
                                                                       size_t count,
                                                                       const uint8_t *table,
                                                                       int first) {
    __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)table));
    size_t j = 0;
    for (; j + 64 <= count; j += 64) {
        __m256i values[2];
        nibble_lookups(packed + j / 2, lut, values);
        for (int half = 0; half < 2; half++) {
            __m128i parts[2] = {_mm256_castsi256_si128(values[half]),
                                _mm256_extracti128_si256(values[half], 1)};
            for (int q = 0; q < 4; q++) {
                __m128i eight = q % 2 ? _mm_srli_si128(parts[q / 2], 8) : parts[q / 2];
                __m256i *out = (__m256i *)(acc + j + 32 * half + 8 * q);
                __m256i lanes = _mm256_cvtepu8_epi32(eight);
                if (!first) lanes = _mm256_add_epi32(lanes, _mm256_loadu_si256(out));
                _mm256_storeu_si256(out, lanes);
            }
        }
    }
    return j;
}
#endif

/* acc[0, n) = or += table[index] of n packed `bits`-bit indices (bits <= 8; a table of up to
   16 entries, zero-padded, is looked up in registers). */
MULTIVERSION static void lookup_accumulate(int32_t *acc, const uint8_t *packed, const uint8_t *end,
                                           size_t n, int bits, const int32_t *table, int first) {
    uint8_t indices[LEAF + 32];
    u32x8 low = {0}, high = {0};
    int small = bits <= 4;
    if (small)
        for (int k = 0; k < 1 << bits; k++) {
            if (k < LANES) low[k] = (uint32_t)table[k];
            else high[k - LANES] = (uint32_t)table[k];
        }
    size_t done = 0;
#if defined(__x86_64__)
    int bytes = bits == 4 && have_avx2;
    uint8_t nibble_table[16];
    for (int k = 0; bytes && k < 16; k++) {
        bytes = table[k] >= 0 && table[k] < 256;
        nibble_table[k] = (uint8_t)table[k];
    }
    if (bytes) done = accumulate_nibbles_avx2(acc, packed, MIN(n, (size_t)(end - packed) * 2),
                                              nibble_table, first);
#endif
    for (size_t c = done; c < n; c += LEAF) {
        size_t count = MIN(LEAF, n - c), i = 0;
        unpack(packed + c / 8 * bits, end, bits, count, indices);
        int32_t *out = acc + c;
#if defined(__GNUC__) && !defined(__clang__)
        if (small)
            for (; i + LANES <= count; i += LANES) {
                u8x8 bytes;
                memcpy(&bytes, indices + i, sizeof bytes);
                u32x8 index = __builtin_convertvector(bytes, u32x8);
                u32x8 value = (__builtin_shuffle(low, index) & (u32x8)(index < LANES)) |
                              (__builtin_shuffle(high, index) & (u32x8)(index >= LANES));
                i32x8 sum = (i32x8)value;
                if (!first) sum += load_i32(out + i);
                memcpy(out + i, &sum, sizeof sum);
            }
#endif
        for (; i < count; i++) out[i] = (first ? 0 : out[i]) + table[indices[i]];
    }
}

/* The low w bits (w <= 16) of int32 values[0, n), packed at out. */
MULTIVERSION static void pack_int32(const int32_t *values, size_t n, int w, uint8_t *out,
                                    const uint8_t *end) {
    union {
        uint8_t narrow[LEAF + 32];
        uint16_t wide[LEAF + 16];
    } lanes;
    for (size_t c = 0; c < n; c += LEAF) {
        size_t count = MIN(LEAF, n - c);
        if (w <= 8) {
            for (size_t i = 0; i < count; i++) lanes.narrow[i] = (uint8_t)values[c + i];
            memset(lanes.narrow + count, 0, 32);
        } else {
            for (size_t i = 0; i < count; i++) lanes.wide[i] = (uint16_t)values[c + i];
            memset(lanes.wide + count, 0, 32);
        }
        pack(&lanes, count, w, out + c / 8 * w, end);
    }
}

/* ---------------------------------------------------------------------------------------------
 * Tensor scales: every piece of a partition (one tensor's coordinates) divided or multiplied by
 * its own factor, as torch's elementwise operations round them (one IEEE operation each).
 */
MULTIVERSION static void scale_pieces(const float *src, float *dst, const int64_t *lengths,
                                      const float *factors, size_t pieces, int divide) {
    size_t at = 0;
    for (size_t p = 0; p < pieces; p++) {
        size_t n = (size_t)lengths[p];
        float f = factors[p];
        if (divide)
            for (size_t i = at; i < at + n; i++) dst[i] = src[i] / f;
        else
            for (size_t i = at; i < at + n; i++) dst[i] = src[i] * f;
        at += n;
    }
}

/* Error feedback's memory outside the rotated domain: dst = x - own * factors[p] over each piece
   p (the tensor scales; none: dst = x - own), as torch's scale by the factor then subtraction
   round it (the product on its own: (own * f) * one, the one opaque, is never fused into the
   difference). One pass instead of a scale in place and a subtraction into a new tensor. */
MULTIVERSION static void residual_pieces(const float *x, const float *own, float *dst, size_t n,
                                         const int64_t *lengths, const float *factors,
                                         size_t pieces) {
    float one = opaque_one;
    if (!pieces) {
        for (size_t i = 0; i < n; i++) dst[i] = x[i] - own[i];
        return;
    }
    size_t at = 0;
    for (size_t p = 0; p < pieces; p++) {
        float f = factors[p];
        for (size_t i = at; i < at + (size_t)lengths[p]; i++) dst[i] = x[i] - (own[i] * f) * one;
        at += (size_t)lengths[p];
    }
}

/* ---------------------------------------------------------------------------------------------
 * Sums of squares in one defined order, so that a kernel that already reads a vector gives its
 * norm on the way (the summary, error feedback's bound) and every caller, whatever the CPU or
 * vector width, gets the same bits: coordinate k of a range goes to lane k % 64, each square
 * rounded to float32 and added in float32 over a span of SQUARES_SPAN coordinates (64 per
 * lane), each span's lane sums then added in float64; the 64 lanes fold pairwise (lane l + 32,
 * then + 16, ..., + 1) and the total rounds to float32 once. Short float32 chains and a float64
 * total keep it closer to the exact sum than one float32 chain, and 64 lanes are eight
 * independent vector chains: the additions' latency stays under the loads'.
 */
enum { SQUARES_SPAN = 4096, SQUARES_LANES = 64 };
_Static_assert((int)LEAF == (int)SQUARES_SPAN, "a transform's leaf is a span of the sums of squares");

struct squares {
    double lane[SQUARES_LANES];
};

#if HAVE_WIDE
/* A span's float32 lane sums (squares_add's) sixteen lanes a vector: each lane adds the same
   squares in the same order, so the sums are the eight-wide loop's bits. With `e` (and `out`),
   the span of x + e is stored at `out` and the squares of x and of e are summed (into
   sums_x and sums_e) in the same loop: error feedback's accumulate; with `sums_out` too, the
   squares of x + e (the measured rotation's leaf, a span of its own). */
WIDE void squares_span16(const float *x, const float *e, float *out, size_t count,
                         float *sums_x, float *sums_e, float *sums_out) {
    enum { VECTORS = SQUARES_LANES / WLANES };
    f32x16 one = (f32x16){0} + opaque_one, sx[VECTORS] = {{0}}, se[VECTORS] = {{0}};
    f32x16 so[VECTORS] = {{0}};
    size_t i = 0;
    for (; i + SQUARES_LANES <= count; i += SQUARES_LANES)
#pragma GCC unroll 4
        for (int v = 0; v < VECTORS; v++) {
            f32x16 a = load16(x + i + v * WLANES);
            sx[v] = (a * a) * one + sx[v];
            if (e) {
                f32x16 b = load16(e + i + v * WLANES), c = a + b;
                se[v] = (b * b) * one + se[v];
                if (sums_out) so[v] = (c * c) * one + so[v];
                store16(out + i + v * WLANES, c);
            }
        }
    if (i < count) {
        float tail_x[SQUARES_LANES] = {0}, tail_e[SQUARES_LANES] = {0};
        memcpy(tail_x, x + i, (count - i) * sizeof(float));
        if (e) memcpy(tail_e, e + i, (count - i) * sizeof(float));
        for (int v = 0; v < VECTORS; v++) {
            f32x16 a = load16(tail_x + v * WLANES), b = load16(tail_e + v * WLANES), c = a + b;
            sx[v] = (a * a) * one + sx[v];
            se[v] = (b * b) * one + se[v];
            so[v] = (c * c) * one + so[v];
        }
        if (e)
            for (size_t k = i; k < count; k++) out[k] = x[k] + e[k];
    }
    for (int v = 0; v < VECTORS; v++) {
        memcpy(sums_x + v * WLANES, &sx[v], sizeof sx[v]);
        if (e) memcpy(sums_e + v * WLANES, &se[v], sizeof se[v]);
        if (sums_out) memcpy(sums_out + v * WLANES, &so[v], sizeof so[v]);
    }
}
#else
static void squares_span16(const float *x, const float *e, float *out, size_t count,
                           float *sums_x, float *sums_e, float *sums_out) {
    (void)x, (void)e, (void)out, (void)count, (void)sums_x, (void)sums_e, (void)sums_out;
}
#endif

/* squares_span16 eight floats wide: the 64 lanes in two halves of 32, each half a pass over
   the span (four accumulators of each sum, twelve registers of sixteen, where 64 lanes at once
   would spill 24); each lane adds the same squares in the same order, so the same bits. `out`
   may be x: every coordinate is read before it is written, once. */
MULTIVERSION static void squares_span8(const float *x, const float *e, float *out, size_t count,
                                       float *sums_x, float *sums_e, float *sums_out) {
    enum { HALF = SQUARES_LANES / 2, VECTORS = HALF / LANES };
    f32x8 one = (f32x8){0} + opaque_one;
    size_t whole = count / SQUARES_LANES * SQUARES_LANES;
    float tail_x[SQUARES_LANES] = {0}, tail_e[SQUARES_LANES] = {0};
    if (whole < count) {
        memcpy(tail_x, x + whole, (count - whole) * sizeof(float));
        if (e) memcpy(tail_e, e + whole, (count - whole) * sizeof(float));
    }
    for (size_t half = 0; half < 2; half++) {
        f32x8 sx[VECTORS] = {{0}}, se[VECTORS] = {{0}}, so[VECTORS] = {{0}};
        for (size_t i = half * HALF; i < whole; i += SQUARES_LANES)
#pragma GCC unroll 4
            for (int v = 0; v < VECTORS; v++) {
                f32x8 a = load(x + i + v * LANES);
                sx[v] = (a * a) * one + sx[v];
                if (e) {
                    f32x8 b = load(e + i + v * LANES), c = a + b;
                    se[v] = (b * b) * one + se[v];
                    if (sums_out) so[v] = (c * c) * one + so[v];
                    store(out + i + v * LANES, c);
                }
            }
        if (whole < count)
            for (int v = 0; v < VECTORS; v++) {
                f32x8 a = load(tail_x + half * HALF + v * LANES);
                f32x8 b = load(tail_e + half * HALF + v * LANES), c = a + b;
                sx[v] = (a * a) * one + sx[v];
                se[v] = (b * b) * one + se[v];
                so[v] = (c * c) * one + so[v];
            }
        for (int v = 0; v < VECTORS; v++) {
            memcpy(sums_x + half * HALF + v * LANES, &sx[v], sizeof sx[v]);
            if (e) memcpy(sums_e + half * HALF + v * LANES, &se[v], sizeof se[v]);
            if (sums_out) memcpy(sums_out + half * HALF + v * LANES, &so[v], sizeof so[v]);
        }
    }
    if (e)
        for (size_t k = whole; k < count; k++) out[k] = tail_x[k - whole] + tail_e[k - whole];
}

/* One span's sums (and x + e), at whichever width the CPU runs. */
static void squares_span(const float *x, const float *e, float *out, size_t count,
                         float *sums_x, float *sums_e, float *sums_out) {
    if (use_wide)
        squares_span16(x, e, out, count, sums_x, sums_e, sums_out);
    else
        squares_span8(x, e, out, count, sums_x, sums_e, sums_out);
}

/* The float32 lane sums of a span, added to s in float64 (squares_add's last step). */
static void squares_lanes_add(struct squares *s, const float *sums) {
    for (int lane = 0; lane < SQUARES_LANES; lane++) s->lane[lane] += (double)sums[lane];
}

/* Adds the squares of p[0, count) as the coordinates `done`.. of the range (done a multiple of
   SQUARES_SPAN, count at most one span: callers split at spans). The product is rounded on its
   own ((v * v) * one, the one opaque: a multiply-add of it rounds as the addition alone). */
MULTIVERSION static void squares_add(struct squares *s, const float *p, size_t count) {
    enum { VECTORS = SQUARES_LANES / LANES };
    if (use_wide) {
        float sums[SQUARES_LANES];
        squares_span16(p, NULL, NULL, count, sums, NULL, NULL);
        squares_lanes_add(s, sums);
        return;
    }
    f32x8 one = (f32x8){0} + opaque_one, sum[VECTORS] = {{0}};
    size_t i = 0;
    for (; i + SQUARES_LANES <= count; i += SQUARES_LANES)
        for (int v = 0; v < VECTORS; v++) {
            f32x8 a = load(p + i + v * LANES);
            sum[v] = (a * a) * one + sum[v];
        }
    if (i < count) {
        float tail[SQUARES_LANES] = {0};
        memcpy(tail, p + i, (count - i) * sizeof(float));
        for (int v = 0; v < VECTORS; v++) {
            f32x8 a = load(tail + v * LANES);
            sum[v] = (a * a) * one + sum[v];
        }
    }
    for (int v = 0; v < VECTORS; v++)
        for (int lane = 0; lane < LANES; lane++) s->lane[v * LANES + lane] += (double)sum[v][lane];
}

/* The squares of a whole range p[0, count), spans split as squares_add wants them. */
static void squares_range(struct squares *s, const float *p, size_t count) {
    for (size_t at = 0; at < count; at += SQUARES_SPAN)
        squares_add(s, p + at, MIN((size_t)SQUARES_SPAN, count - at));
}

static float squares_total(const struct squares *s) {
    double t[SQUARES_LANES];
    memcpy(t, s->lane, sizeof t);
    for (int width = SQUARES_LANES / 2; width >= 1; width /= 2)
        for (int lane = 0; lane < width; lane++) t[lane] += t[lane + width];
    return (float)t[0];
}

/* Every piece's sum of squares (the tensor scales' norms), each piece a range of its own. */
static void piece_squares(const float *src, const int64_t *lengths, size_t pieces, float *sums) {
    size_t at = 0;
    for (size_t p = 0; p < pieces; p++) {
        struct squares s = {{0}};
        squares_range(&s, src + at, (size_t)lengths[p]);
        sums[p] = squares_total(&s);
        at += (size_t)lengths[p];
    }
}

/* Error feedback's x' = x + e outside the rotated domain, in one pass that also gives the sums
   of squares of x and of e (the bound's norms) and of every piece of x' (the summary; `ends`:
   the pieces' ends, the last n; none: one piece), each in squares_add's order: x' is written a
   span at a time and the pieces' spans that are complete are summed behind it, still in cache. */
MULTIVERSION static void accumulate(const float *x, const float *e, float *out, size_t n,
                                    const int64_t *ends, size_t pieces, float *sums,
                                    float *x_squares, float *e_squares) {
    struct squares sx = {{0}}, se = {{0}}, sp = {{0}};
    size_t count = pieces ? pieces : 1, p = 0, at = 0; /* piece p's next span starts at `at` */
    for (size_t g = 0; g < n; g += SQUARES_SPAN) {
        size_t m = MIN((size_t)SQUARES_SPAN, n - g);
        float sums_x[SQUARES_LANES], sums_e[SQUARES_LANES]; /* one loop: x + e, both squares */
        squares_span(x + g, e + g, out + g, m, sums_x, sums_e, NULL);
        squares_lanes_add(&sx, sums_x);
        squares_lanes_add(&se, sums_e);
        while (p < count) {
            size_t end = pieces ? (size_t)ends[p] : n;
            size_t stop = MIN(at + SQUARES_SPAN, end);
            if (stop > g + m) break; /* not written yet */
            squares_add(&sp, out + at, stop - at);
            at = stop;
            if (at == end) {
                sums[p++] = squares_total(&sp);
                memset(&sp, 0, sizeof sp);
            }
        }
    }
    for (; p < count; p++) sums[p] = 0; /* empty pieces at the end (n == 0) */
    *x_squares = squares_total(&sx);
    *e_squares = squares_total(&se);
}

/* ---------------------------------------------------------------------------------------------
 * Python bindings. Addresses arrive as ints; native.py guarantees what they point to.
 */

#define ADDRESS(type, value) ((type)(uintptr_t)(value))

static int check_block(Py_ssize_t n, Py_ssize_t block) {
    if (block < LANES || (block & (block - 1)) || n % block) {
        PyErr_Format(PyExc_ValueError, "block %zd must be a power of two >= %d dividing %zd",
                     block, LANES, n);
        return 0;
    }
    return 1;
}

static int check_width(int w, int max_width) {
    if (w < 1 || w > max_width) {
        PyErr_Format(PyExc_ValueError, "bit width %d is not in 1..%d", w, max_width);
        return 0;
    }
    return 1;
}

PyDoc_STRVAR(fwht_doc, "fwht(x, n, block, scale): x[0:n] = scale * FWHT of every block, in place");

static PyObject *py_fwht(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long x;
    Py_ssize_t n, block;
    float scale;
    if (!PyArg_ParseTuple(args, "Knnf", &x, &n, &block, &scale) || !check_block(n, block))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    fwht_forward(ADDRESS(float *, x), (size_t)n, (size_t)block, NULL, scale_leaf, &scale);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyDoc_STRVAR(encode_doc,
             "encode(src, length, buffer, n, block, signs, a, c, g, cells, seed, bits, out, out_size\n"
             "       [, error, step, offset, stratum_seed, strata, rank, own, own_a, own_c,\n"
             "        ends, divisors, pieces])\n"
             "Packed table indices of u = clamp(a*y + c, 0, g), y the unnormalised FWHT (in\n"
             "blocks) of src[0:length] * signs padded to n in buffer, or y = src[0:n] if block is 0.\n"
             "With block 0 and an error address: error[i] = y[i] - (T[index] * step + offset),\n"
             "each operation rounded to float32 (torch's mul_, add_ and sub of the decode).\n"
             "With own (a block): buffer[i] = T[index] * own_a + own_c, the rotated values the\n"
             "payload alone decodes to (``inverse`` rotates them back).\n"
             "With pieces (a block): src is multiplied by a / divisors[p] (rounded to float32\n"
             "once) over each piece p (int64 ends, the last being length) as the transform\n"
             "reads it, instead of by a.\n"
             "Returns False, and no indices, where src (rotated or not) holds an Inf or NaN.");

static PyObject *py_encode(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long src, buffer, signs, cells, seed, out, error = 0, stratum_seed = 0;
    unsigned long long ends = 0, divisors = 0;
    Py_ssize_t length, n, block, out_size, pieces = 0;
    int g, bits;
    struct quantizer q = {.step = 0, .offset = 0};
    if (!PyArg_ParseTuple(args, "KnKnnKffiKKiKn|KffKiipffKKn", &src, &length, &buffer, &n,
                          &block, &signs, &q.grid.a, &q.grid.c, &g, &cells, &seed, &bits, &out,
                          &out_size, &error, &q.step, &q.offset, &stratum_seed, &q.strata.n,
                          &q.strata.rank, &q.own, &q.own_a, &q.own_c, &ends, &divisors, &pieces))
        return NULL;
    if (pieces < 0 || (pieces && (!block || !ends || !divisors))) {
        PyErr_SetString(PyExc_ValueError, "the pieces' divisors need a rotated input");
        return NULL;
    }
    if (q.own && !block) {
        PyErr_SetString(PyExc_ValueError, "the own reconstruction needs a rotated input");
        return NULL;
    }
    if (q.strata.n < 0 || (q.strata.n && (q.strata.rank < 0 || q.strata.rank >= q.strata.n))) {
        PyErr_Format(PyExc_ValueError, "rank %d of %d strata", q.strata.rank, q.strata.n);
        return NULL;
    }
    if (q.strata.n) rng16_seed(&q.strata.shared, stratum_seed);
    if (error && block) {
        PyErr_SetString(PyExc_ValueError, "the error output needs an unrotated input (block 0)");
        return NULL;
    }
    if ((block && !check_block(n, block)) || !check_width(bits, 8) || (8 % bits) || g < 1 ||
        g > 4095) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "unsupported bits %d or granularity %d", bits, g);
        return NULL;
    }
    grid_init(&q.grid, g, ADDRESS(const uint32_t *, cells));
    q.bits = bits;
    q.out = ADDRESS(uint8_t *, out);
    q.end = q.out + out_size;
    q.error = ADDRESS(float *, error);
    rng16_seed(&q.rng, seed);
    float *factors = NULL;
    if (pieces && !(factors = PyMem_RawMalloc((size_t)pieces * sizeof *factors)))
        return PyErr_NoMemory();
    int finite = 1;
    Py_BEGIN_ALLOW_THREADS
    if (block) {
        /* a first, not after the transform (linearity): the unnormalised FWHT of a gradient
           whose norm is near the float32 limit would overflow, its scaled values never do */
        struct source in = {ADDRESS(const float *, src), (size_t)length, q.grid.a,
                            ADDRESS(const uint8_t *, signs), ADDRESS(const int64_t *, ends),
                            factors, (size_t)pieces};
        if (pieces) {
            for (Py_ssize_t p = 0; p < pieces; p++)
                factors[p] = (float)((double)q.grid.a / ADDRESS(const float *, divisors)[p]);
            in.scale = 1;
        }
        q.grid.a = 1;
        finite = fwht_forward(ADDRESS(float *, buffer), (size_t)n, (size_t)block, &in,
                              use_wide ? quantize_leaf16 : quantize_leaf, &q);
    } else {
        finite = quantize(&q, ADDRESS(float *, src), (size_t)n);
        store_fence(); /* the error's streaming stores, before the caller reads it */
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(factors);
    return PyBool_FromLong(finite);
}

static void no_visit(void *state, float *leaf, size_t offset, size_t count) {
    (void)state, (void)leaf, (void)offset, (void)count;
}

/* leaf += addend[offset, offset + count): error feedback's memory, added while the leaf is hot */
MULTIVERSION static void add_leaf(void *state, float *leaf, size_t offset, size_t count) {
    const float *addend = (const float *)state + offset;
    for (size_t i = 0; i < count; i++) leaf[i] += addend[i];
}

/* The rotation's leaves, measured: the sums of squares of each finished leaf (R x), of the
   addend and of their sum (the summary of error feedback's rotated input), in squares_add's
   order over the whole vector (leaves are spans of it, visited in order at either width). */
struct measured_leaves {
    const float *addend; /* NULL: none */
    struct squares rotated, added, total;
};

static void measure_leaf(void *state, float *leaf, size_t offset, size_t count) {
    struct measured_leaves *m = state;
    if (m->addend) { /* one loop: the leaf is a span of its own (LEAF) */
        float rotated[SQUARES_LANES], added[SQUARES_LANES], total[SQUARES_LANES];
        squares_span(leaf, m->addend + offset, leaf, count, rotated, added, total);
        squares_lanes_add(&m->rotated, rotated);
        squares_lanes_add(&m->added, added);
        squares_lanes_add(&m->total, total);
        return;
    }
    squares_add(&m->rotated, leaf, count);
}

PyDoc_STRVAR(rotate_doc,
             "rotate(src, length, out, n, block, signs[, addend, measure])\n"
             "out[0:n] = orthonormal FWHT (in blocks) of src[0:length] * signs, zero-padded to n,\n"
             "plus addend[0:n] if given (0: none). Returns False where src holds an Inf or NaN\n"
             "(out is then undefined). With measure: (finite, |R src|^2, |addend|^2, |out|^2),\n"
             "the sums of squares of the rotated source, the addend and out, each in the\n"
             "kernels' order (piece_squares').");

static PyObject *py_rotate(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long src, out, signs, addend = 0;
    Py_ssize_t length, n, block;
    int measure = 0;
    if (!PyArg_ParseTuple(args, "KnKnnK|Kp", &src, &length, &out, &n, &block, &signs, &addend,
                          &measure) ||
        !check_block(n, block))
        return NULL;
    if (length > n) {
        PyErr_Format(PyExc_ValueError, "length %zd exceeds the padded length %zd", length, n);
        return NULL;
    }
    struct source in = {ADDRESS(const float *, src), (size_t)length, 1.0f / sqrtf((float)block),
                        ADDRESS(const uint8_t *, signs), NULL, NULL, 0};
    struct measured_leaves m = {ADDRESS(const float *, addend), {{0}}, {{0}}, {{0}}};
    int finite;
    Py_BEGIN_ALLOW_THREADS
    if (measure)
        finite = fwht_forward(ADDRESS(float *, out), (size_t)n, (size_t)block, &in, measure_leaf,
                              &m);
    else
        finite = fwht_forward(ADDRESS(float *, out), (size_t)n, (size_t)block, &in,
                              addend ? add_leaf : no_visit, ADDRESS(void *, addend));
    Py_END_ALLOW_THREADS
    if (!measure) return PyBool_FromLong(finite);
    float rotated = squares_total(&m.rotated);
    float added = squares_total(&m.added), total = addend ? squares_total(&m.total) : rotated;
    return Py_BuildValue("Nddd", PyBool_FromLong(finite), (double)rotated, (double)added,
                         (double)total);
}

PyDoc_STRVAR(accumulate_doc,
             "accumulate(x, e, out, n, ends, pieces, sums) -> (|x|^2, |e|^2)\n"
             "out[0:n] = x + e (float32, rounded as torch's add), and in the same pass sums[p] =\n"
             "the sum of squares of each piece p of out (int64 ends, the last n; pieces 0: one\n"
             "piece, sums[0]), as piece_squares adds them; returns those of x and of e.");

static PyObject *py_accumulate(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long x, e, out, ends, sums;
    Py_ssize_t n, pieces;
    if (!PyArg_ParseTuple(args, "KKKnKnK", &x, &e, &out, &n, &ends, &pieces, &sums)) return NULL;
    if (n < 0 || pieces < 0 || (pieces && !ends)) {
        PyErr_SetString(PyExc_ValueError, "invalid length or pieces");
        return NULL;
    }
    float xs, es;
    Py_BEGIN_ALLOW_THREADS
    accumulate(ADDRESS(const float *, x), ADDRESS(const float *, e), ADDRESS(float *, out),
               (size_t)n, ADDRESS(const int64_t *, ends), (size_t)pieces, ADDRESS(float *, sums),
               &xs, &es);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("dd", (double)xs, (double)es);
}

/* The sink of optional arguments dst, length, minuend, ends, factors, pieces (dst 0: none) */
static int sink_of(struct sink *sink, unsigned long long dst, Py_ssize_t length,
                   unsigned long long minuend, unsigned long long ends,
                   unsigned long long factors, Py_ssize_t pieces, Py_ssize_t n) {
    if (!dst) return 0;
    if (length < 0 || length > n || pieces < 0 || (pieces && (!ends || !factors))) {
        PyErr_SetString(PyExc_ValueError, "invalid sink: length or pieces");
        return -1;
    }
    *sink = (struct sink){ADDRESS(float *, dst), (size_t)length, ADDRESS(const float *, minuend),
                          {NULL, 0, 1.0f, NULL, ADDRESS(const int64_t *, ends),
                           ADDRESS(const float *, factors), (size_t)pieces},
                          /* error feedback's memory, read again a round later */
                          minuend && dst % 64 == 0};
    return 1;
}

PyDoc_STRVAR(inverse_doc,
             "inverse(x, n, block, signs[, dst, length, minuend, ends, factors, pieces])\n"
             "x[0:n] = the unnormalised FWHT of every block of x, times signs, in place: the\n"
             "decode's transform back, of values already dequantized. With dst, the final\n"
             "values y go to dst[0:length] instead, as minuend - y * factors[p] over each piece\n"
             "p (int64 ends, the last `length`; none: minuend - y), rounded as torch's scale\n"
             "then subtraction: error feedback's residual (x is then left part-transformed).");

static PyObject *py_inverse(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long x, signs, dst = 0, minuend = 0, ends = 0, factors = 0;
    Py_ssize_t n, block, length = 0, pieces = 0;
    if (!PyArg_ParseTuple(args, "KnnK|KnKKKn", &x, &n, &block, &signs, &dst, &length, &minuend,
                          &ends, &factors, &pieces) ||
        !check_block(n, block))
        return NULL;
    struct sink sink;
    int sunk = sink_of(&sink, dst, length, minuend, ends, factors, pieces, n);
    if (sunk < 0) return NULL;
    if (sunk && !minuend) {
        PyErr_SetString(PyExc_ValueError, "the inverse's sink needs a minuend");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    fwht_reverse(ADDRESS(float *, x), (size_t)n, (size_t)block, no_visit, NULL,
                 ADDRESS(const uint8_t *, signs), sunk ? &sink : NULL);
    store_fence(); /* the sink's streaming stores, before the caller reads them */
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyDoc_STRVAR(lookup_sum_doc,
             "lookup_sum(payloads, bits, table, n, w, out, out_size)\n"
             "out = the sums over payloads (addresses of packed bits-bit indices) of table[index]\n"
             "(int32, 2**bits entries, below 2**w), packed in w <= 16 bits.");

static PyObject *py_lookup_sum(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *addresses;
    unsigned long long table, out;
    Py_ssize_t n, out_size;
    struct lookup_sum op;
    if (!PyArg_ParseTuple(args, "OiKniKn", &addresses, &op.bits, &table, &n, &op.w, &out, &out_size))
        return NULL;
    if (!check_width(op.bits, 8) || (8 % op.bits) || !check_width(op.w, 16)) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "unsupported index width %d", op.bits);
        return NULL;
    }
    PyObject *sequence = PySequence_Fast(addresses, "payloads must be a sequence of addresses");
    if (!sequence)
        return NULL;
    op.payload_count = (size_t)PySequence_Fast_GET_SIZE(sequence);
    const uint8_t **payloads = PyMem_Malloc((op.payload_count + 1) * sizeof *payloads);
    if (!payloads) {
        Py_DECREF(sequence);
        return PyErr_NoMemory();
    }
    for (size_t p = 0; p < op.payload_count; p++)
        payloads[p] = PyLong_AsVoidPtr(PySequence_Fast_GET_ITEM(sequence, (Py_ssize_t)p));
    Py_DECREF(sequence);
    if (PyErr_Occurred()) {
        PyMem_Free(payloads);
        return NULL;
    }
    const int32_t *values = ADDRESS(const int32_t *, table);
    int32_t largest = 0;
    int entries = 1 << op.bits;
    for (int k = 0; k < entries; k++) {
        op.table[k] = (uint16_t)values[k];
        largest = values[k] > largest ? values[k] : largest;
    }
    int nibbles = entries < 16 ? entries : 16; /* the first 16 entries, for 4-bit lookups */
    for (int k = 0; k < nibbles; k++) op.nibble_table[k] = (uint8_t)values[k];
    op.nibble = op.bits == 4 && largest < 256;
    op.payloads = payloads;
    op.n = (size_t)n;
    op.out = ADDRESS(uint8_t *, out);
    op.end = op.out + out_size;
    Py_BEGIN_ALLOW_THREADS
    lookup_sum(&op);
    Py_END_ALLOW_THREADS
    PyMem_Free(payloads);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(lookup_accumulate_doc,
             "lookup_accumulate(acc, packed, packed_size, n, bits, table, first)\n"
             "acc[0:n] (int32) = (first) or += table[index] (int32, 2**bits entries) of the n\n"
             "packed bits-bit indices (bits in 1, 2, 4, 8).");

static PyObject *py_lookup_accumulate(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long acc, packed, table;
    Py_ssize_t packed_size, n;
    int bits, first;
    if (!PyArg_ParseTuple(args, "KKnniKp", &acc, &packed, &packed_size, &n, &bits, &table, &first))
        return NULL;
    if (!check_width(bits, 8) || (8 % bits)) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "unsupported index width %d", bits);
        return NULL;
    }
    const uint8_t *in = ADDRESS(const uint8_t *, packed);
    Py_BEGIN_ALLOW_THREADS
    lookup_accumulate(ADDRESS(int32_t *, acc), in, in + packed_size, (size_t)n, bits,
                      ADDRESS(const int32_t *, table), first);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyDoc_STRVAR(pack_int32_doc,
             "pack_int32(values, n, w, out, out_size)\n"
             "out = the low w (<= 16) bits of int32 values[0:n], packed (bits.py's layout).");

static PyObject *py_pack_int32(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long values, out;
    Py_ssize_t n, out_size;
    int w;
    if (!PyArg_ParseTuple(args, "KniKn", &values, &n, &w, &out, &out_size) || !check_width(w, 16))
        return NULL;
    uint8_t *to = ADDRESS(uint8_t *, out);
    Py_BEGIN_ALLOW_THREADS
    pack_int32(ADDRESS(const int32_t *, values), (size_t)n, w, to, to + out_size);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyDoc_STRVAR(decode_doc,
             "decode(packed, packed_size, w, n, a, c, out, block, signs[, ends, factors, pieces])\n"
             "out[0:n] = a*S + c for the w-bit packed sums S; then, if block, the unnormalised\n"
             "FWHT of every block, times signs. With pieces (int64 ends, float32 factors), out\n"
             "is then multiplied by factors[p] over each piece p, as the values are stored\n"
             "(the tensor scales; the coordinates past the last end are left undefined).");

static PyObject *py_decode(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long packed, out, signs, ends = 0, factors = 0;
    Py_ssize_t packed_size, n, block, pieces = 0;
    int w;
    float a, c;
    if (!PyArg_ParseTuple(args, "KninffKnK|KKn", &packed, &packed_size, &w, &n, &a, &c, &out,
                          &block, &signs, &ends, &factors, &pieces) ||
        !check_width(w, 16) || (block && !check_block(n, block)))
        return NULL;
    struct sink sink;
    int sunk = 0;
    if (pieces) {
        int64_t length = ADDRESS(const int64_t *, ends)[pieces - 1];
        sunk = sink_of(&sink, out, (Py_ssize_t)length, 0, ends, factors, pieces, n);
        if (sunk < 0) return NULL;
    }
    const uint8_t *in = ADDRESS(const uint8_t *, packed);
    Py_BEGIN_ALLOW_THREADS
    struct dequantizer d = {in, in + packed_size, w, a, c};
    leaf_visitor visit = use_wide && have_vbmi ? dequantize_leaf16 : dequantize_leaf;
    float *y = ADDRESS(float *, out);
    if (block) {
        fwht_reverse(y, (size_t)n, (size_t)block, visit, &d, ADDRESS(const uint8_t *, signs),
                     sunk ? &sink : NULL);
    } else {
        for (size_t offset = 0; offset < (size_t)n; offset += LEAF)
            visit(&d, y + offset, offset, MIN(LEAF, (size_t)n - offset));
        if (sunk) sink_apply(&sink, y);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyDoc_STRVAR(scale_pieces_doc,
             "scale_pieces(src, dst, lengths, factors, pieces, divide)\n"
             "dst = src / factors[p] (divide) or src * factors[p] over each of the pieces (int64\n"
             "lengths, float32 factors) that src holds one after another; dst may be src.");

static PyObject *py_scale_pieces(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long src, dst, lengths, factors;
    Py_ssize_t pieces;
    int divide;
    if (!PyArg_ParseTuple(args, "KKKKnp", &src, &dst, &lengths, &factors, &pieces, &divide))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    scale_pieces(ADDRESS(const float *, src), ADDRESS(float *, dst),
                 ADDRESS(const int64_t *, lengths), ADDRESS(const float *, factors),
                 (size_t)pieces, divide);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyDoc_STRVAR(residual_pieces_doc,
             "residual_pieces(x, own, dst, n, lengths, factors, pieces)\n"
             "dst[0:n] = x - own * factors[p] over each of the pieces (int64 lengths, float32\n"
             "factors), or x - own with no pieces, rounded as torch's mul then sub.");

static PyObject *py_residual_pieces(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long x, own, dst, lengths, factors;
    Py_ssize_t n, pieces;
    if (!PyArg_ParseTuple(args, "KKKnKKn", &x, &own, &dst, &n, &lengths, &factors, &pieces))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    residual_pieces(ADDRESS(const float *, x), ADDRESS(const float *, own), ADDRESS(float *, dst),
                    (size_t)n, ADDRESS(const int64_t *, lengths), ADDRESS(const float *, factors),
                    (size_t)pieces);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyDoc_STRVAR(piece_squares_doc,
             "piece_squares(src, lengths, pieces, sums)\n"
             "sums[p] (float32) = the sum of squares of piece p of src (int64 lengths), added in\n"
             "the kernels' order: 64 lanes of float32 sums over spans of 4096 coordinates, their\n"
             "span sums added in float64, the lanes folded pairwise.");

static PyObject *py_piece_squares(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long src, lengths, sums;
    Py_ssize_t pieces;
    if (!PyArg_ParseTuple(args, "KKnK", &src, &lengths, &pieces, &sums)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    piece_squares(ADDRESS(const float *, src), ADDRESS(const int64_t *, lengths), (size_t)pieces,
                  ADDRESS(float *, sums));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyDoc_STRVAR(wide_doc,
             "wide([on]) -> bool\n"
             "Whether the sixteen-float (AVX-512) kernels run; with `on`, switches them on (where\n"
             "the CPU has them) or off first: tests compare both ways bit for bit.");

static PyObject *py_wide(PyObject *Py_UNUSED(self), PyObject *args) {
    int on = -1;
    if (!PyArg_ParseTuple(args, "|p", &on)) return NULL;
#if HAVE_WIDE
    if (on >= 0) {
        __builtin_cpu_init();
        use_wide = on && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                   __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                   __builtin_cpu_supports("bmi2");
    }
#endif
    return PyBool_FromLong(use_wide);
}

PyDoc_STRVAR(v3_doc,
             "v3([on]) -> bool\n"
             "Whether the x86-64-v3 (AVX2) paths run: the rounding of 4-bit indices (sixteen\n"
             "coordinates a step, packed in registers) and the dequantization of sums of up to\n"
             "8 bits (read from the packed bytes); with `on`, switches them on (where the CPU\n"
             "has AVX2) or off first: tests compare them with the generic loops bit for bit.");

static PyObject *py_v3(PyObject *Py_UNUSED(self), PyObject *args) {
    int on = -1;
    if (!PyArg_ParseTuple(args, "|p", &on)) return NULL;
#if HAVE_V3
    if (on >= 0) use_v3 = on && have_v3;
#endif
    return PyBool_FromLong(use_v3);
}

static PyMethodDef methods[] = {
    {"wide", py_wide, METH_VARARGS, wide_doc},
    {"v3", py_v3, METH_VARARGS, v3_doc},
    {"fwht", py_fwht, METH_VARARGS, fwht_doc},
    {"encode", py_encode, METH_VARARGS, encode_doc},
    {"rotate", py_rotate, METH_VARARGS, rotate_doc},
    {"inverse", py_inverse, METH_VARARGS, inverse_doc},
    {"lookup_accumulate", py_lookup_accumulate, METH_VARARGS, lookup_accumulate_doc},
    {"pack_int32", py_pack_int32, METH_VARARGS, pack_int32_doc},
    {"lookup_sum", py_lookup_sum, METH_VARARGS, lookup_sum_doc},
    {"decode", py_decode, METH_VARARGS, decode_doc},
    {"scale_pieces", py_scale_pieces, METH_VARARGS, scale_pieces_doc},
    {"piece_squares", py_piece_squares, METH_VARARGS, piece_squares_doc},
    {"residual_pieces", py_residual_pieces, METH_VARARGS, residual_pieces_doc},
    {"accumulate", py_accumulate, METH_VARARGS, accumulate_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_kernels",
    .m_doc = "Native CPU kernels for THC (see native.py).",
    .m_size = -1,
    .m_methods = methods,
};

static const struct thc_lane_api lanes_api = {lookup_accumulate, pack_int32};

PyMODINIT_FUNC PyInit__kernels(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    have_avx2 = __builtin_cpu_supports("avx2");
#if HAVE_V3
    use_v3 = have_v3 = __builtin_cpu_supports("x86-64-v3");
#endif
#if HAVE_WIDE
    have_vbmi = __builtin_cpu_supports("avx512vbmi");
#endif
    PyObject *on = PyTuple_Pack(1, Py_True);
    if (on == NULL) return NULL;
    PyObject *wide = py_wide(NULL, on);
    Py_DECREF(on);
    if (wide == NULL) return NULL;
    Py_DECREF(wide);
#endif
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    /* for the switch's native slot pools (dataplane/_pool.c) */
    PyObject *capsule = PyCapsule_New((void *)&lanes_api, THC_LANE_API_CAPSULE, NULL);
    if (capsule == NULL || PyModule_AddObject(m, "lanes_api", capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
