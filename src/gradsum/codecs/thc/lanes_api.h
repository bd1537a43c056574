/* The lane kernels of THC's switch slots (_kernels.c), exported to other extensions as a capsule:
 * ``PyCapsule_Import(THC_LANE_API_CAPSULE, 0)`` returns a ``const struct thc_lane_api *``. */
#ifndef GRADSUM_THC_LANES_API_H
#define GRADSUM_THC_LANES_API_H

#include <stddef.h>
#include <stdint.h>

#define THC_LANE_API_CAPSULE "gradsum.codecs.thc._kernels.lanes_api"

struct thc_lane_api {
    /* acc[0, n) = (first) or += table[index] of n packed `bits`-bit indices (8 % bits == 0) */
    void (*lookup_accumulate)(int32_t *acc, const uint8_t *packed, const uint8_t *end, size_t n,
                              int bits, const int32_t *table, int first);
    /* the low w (<= 16) bits of values[0, n), packed at out (bits.py's layout) */
    void (*pack_int32)(const int32_t *values, size_t n, int w, uint8_t *out, const uint8_t *end);
};

#endif
