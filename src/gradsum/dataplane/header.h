/* The gradsum packet header (dataplane/packet.py, docs/protocol.md) for the C extensions: the
 * switch's native pools (dataplane/_pool.c) and the worker's pump (net/_pump.c). */
#ifndef GRADSUM_HEADER_H
#define GRADSUM_HEADER_H

#include <stdint.h>
#include <string.h>

#define GS_HEADER_SIZE 40
#define GS_PROTOCOL 2
#define GS_KNOWN_FLAGS 3 /* PRESUMMED | PARTIAL */

enum gs_kind { GS_DATA = 1, GS_RESULT = 2, GS_STALE = 3 };

struct gs_header {
    uint8_t kind, version, op, flags;
    uint16_t job, worker, contributors;
    uint32_t slot, elements;
    uint64_t chunk;
    uint64_t token; /* the job's data token: equal, or the packet is not the job's */
};

/* The fields of the 40 bytes at b; 0 where magic, protocol, version, flags or the reserved
   fields say it is no gradsum header (kind and op are the caller's to judge). */
static inline int gs_parse(const uint8_t *b, struct gs_header *h) {
    uint16_t reserved;
    if (b[0] != 'G' || b[1] != 'S' || b[2] != GS_PROTOCOL) return 0;
    h->kind = b[3];
    memcpy(&h->job, b + 4, 2);
    memcpy(&h->worker, b + 6, 2);
    memcpy(&h->slot, b + 8, 4);
    h->version = b[12];
    h->op = b[13];
    h->flags = b[14];
    memcpy(&h->chunk, b + 16, 8);
    memcpy(&h->elements, b + 24, 4);
    memcpy(&h->contributors, b + 28, 2);
    memcpy(&reserved, b + 30, 2);
    memcpy(&h->token, b + 32, 8);
    return h->version <= 1 && !(h->flags & ~GS_KNOWN_FLAGS) && b[15] == 0 && reserved == 0;
}

static inline void gs_pack(uint8_t *b, const struct gs_header *h) {
    memset(b, 0, GS_HEADER_SIZE);
    b[0] = 'G', b[1] = 'S', b[2] = GS_PROTOCOL, b[3] = h->kind;
    memcpy(b + 4, &h->job, 2);
    memcpy(b + 6, &h->worker, 2);
    memcpy(b + 8, &h->slot, 4);
    b[12] = h->version, b[13] = h->op, b[14] = h->flags;
    memcpy(b + 16, &h->chunk, 8);
    memcpy(b + 24, &h->elements, 4);
    memcpy(b + 28, &h->contributors, 2);
    memcpy(b + 32, &h->token, 8);
}

#endif
