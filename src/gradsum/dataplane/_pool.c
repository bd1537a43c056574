/* A slot pool of an integer-sum job in C: slots.py's SlotPool for the jobs a switch serves most,
 * packet for packet the same decisions, and a daemon loop that receives, aggregates and sends
 * without entering Python.
 *
 * slots.py stays the definition (and serves everything this does not: collecting ops, quorums,
 * parents); tests/dataplane/test_native_pool.py feeds both the same packets and compares every
 * action and counter. Two entry points:
 *
 *   Pool.process(worker, slot, version, op, flags, chunk, elements, contributors, payload,
 *                token)
 *       sans-IO: one DATA packet whose job, worker and source the caller checked; returns the
 *       actions as tuples (see native_pool.py).
 *   serve(fd, pools, buffer, limit, drop_in, drop_out, rng) -> (handled, sent, failures,
 *                                                               dropped_in, dropped_out, size, source)
 *       the daemon's loop: receives datagrams into `buffer` and handles those of the pools'
 *       jobs from their workers' addresses, sending results itself, until the socket is empty,
 *       `limit` were handled, or a datagram needs Python (anything else: control, another job,
 *       a stranger, a malformed header), which is left in `buffer` (size, source) for it.
 *       drop_in/drop_out: injected loss (rng: its uint64 state), as net/loss.py's drops.
 *
 * Lane arithmetic: int32 adds and maxes here; THC's table lookups and result packing through the
 * capsule of gradsum.codecs.thc._kernels (its AVX2 kernels), else in plain C.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include "../codecs/thc/lanes_api.h"
#include "../net/udp_offload.h"
#include "header.h"

#define HEADER_SIZE GS_HEADER_SIZE
/* The int32 lane loops in AVX2 and SSE2 clones picked at load time: written as plain loops over
 * restrict pointers, each vectorises (without `restrict` GCC kept the sum scalar, one add per
 * lane through memory: half the switch's CPU at 2^22 elements). */
#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define MULTIVERSION __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef MULTIVERSION
#define MULTIVERSION
#endif

#define MAX_DATAGRAM 65507
#define ANY_WORKER 0xFFFF
#define SEND_WAIT_MS 20 /* daemon.py's: how long a full send buffer may stall one send */

enum op { OP_NONE = 0, OP_SUM = 1, OP_MAX = 2 };
enum flag { PRESUMMED = 1, PARTIAL = 2 };
enum state { EMPTY = 0, OPEN = 1, COMPLETE = 2 };
enum action { SEND_MULTICAST = 1, SEND_UNICAST = 2, SEND_STALE = 3, DROP = 4, STORE = 5 };

/* counters: the names slots.py counts (dropped_* for drops), in this order */
#define COUNTERS(X)                                                                            \
    X(STORED, "stored")                                                                        \
    X(COMPLETED, "completed")                                                                  \
    X(MULTICASTS, "multicasts")                                                                \
    X(ANSWERED, "retransmissions_answered")                                                    \
    X(LATE, "late_contributions")                                                              \
    X(STALE, "stale")                                                                          \
    X(BAD_SLOT, "dropped_bad_slot")                                                            \
    X(BAD_CHUNK, "dropped_bad_chunk")                                                          \
    X(BAD_ELEMENTS, "dropped_bad_elements")                                                    \
    X(BAD_CONTRIBUTORS, "dropped_bad_contributors")                                            \
    X(BAD_FLAGS, "dropped_bad_flags")                                                          \
    X(BAD_OP, "dropped_bad_op")                                                                \
    X(WRONG_LENGTH, "dropped_wrong_length")                                                    \
    X(OUT_OF_STEP, "dropped_out_of_step")                                                      \
    X(MISMATCH, "dropped_mismatch")                                                            \
    X(DUPLICATE, "dropped_duplicate")                                                          \
    X(TOO_MANY, "dropped_too_many_contributors")                                              \
    X(OVERFLOW, "dropped_overflow")                                                            \
    X(BAD_TOKEN, "dropped_bad_token")
#define AS_ENUM(id, name) C_##id,
#define AS_NAME(id, name) name,
enum counter { COUNTERS(AS_ENUM) NCOUNTERS };
static const char *counter_names[] = {COUNTERS(AS_NAME)};

typedef struct {
    int64_t chunk; /* -1: never opened */
    uint8_t state, op, flags;
    uint32_t elements, arrivals, contributors;
    uint8_t *result;  /* what RESULT packets carry: the accumulator, or `packed` */
    size_t result_size;
} Round;

typedef struct {
    PyObject_HEAD
    uint16_t job;
    uint64_t token;       /* the job's data token (authentication.data_token; 0: none) */
    uint32_t workers, slots, elements, max_contributors;
    int in_bits, out_bits, is_signed;
    int32_t table[256];   /* lane value of each index (unsigned jobs) */
    int32_t max_lane;     /* the table's largest entry: what one contribution adds at most */
    struct sockaddr_in *addresses;
    struct sockaddr_in group;
    int has_group;
    int32_t *acc;         /* [2][slots][elements], the caller's array (native_pool.py's acc) */
    Py_buffer acc_view;
    uint8_t *packed;      /* [2][slots][packed bytes]: results narrower than 32 bits */
    size_t packed_stride;
    uint8_t *seen;        /* [2][slots][workers] */
    Round *rounds;        /* [2][slots] */
    long long counts[NCOUNTERS];
    const struct thc_lane_api *lanes;
} Pool;

/* what one packet asks the shell to do (at most one send; a Store before it) */
struct outcome {
    int action;          /* SEND_* or DROP, 0: nothing but a store */
    int stored;          /* a Store action precedes it */
    int counter;         /* DROP: which */
    uint16_t to_worker;  /* SEND_UNICAST / SEND_STALE */
    uint8_t header[HEADER_SIZE];
    const uint8_t *payload;
    size_t payload_size;
};

static size_t packed_nbytes(size_t n, int bits) { return (n * (size_t)bits + 7) / 8; }

/* a DATA packet with a valid op; packet.py judges everything else */
static int parse(const uint8_t *b, size_t size, struct gs_header *h) {
    return size >= HEADER_SIZE && size <= MAX_DATAGRAM && gs_parse(b, h) && h->kind == GS_DATA &&
           h->op <= OP_MAX;
}

static void pack_header(uint8_t *b, uint8_t kind, uint16_t job, uint16_t worker, uint32_t slot,
                        uint8_t version, uint8_t op, uint8_t flags, uint64_t chunk,
                        uint32_t elements, uint16_t contributors, uint64_t token) {
    struct gs_header h = {.kind = kind, .version = version, .op = op, .flags = flags,
                          .job = job, .worker = worker, .contributors = contributors,
                          .slot = slot, .elements = elements, .chunk = chunk, .token = token};
    gs_pack(b, &h);
}

static void drop(Pool *p, struct outcome *o, int counter) {
    p->counts[counter]++;
    o->action = DROP, o->counter = counter;
}

static void reply_result(Pool *p, const Round *r, struct outcome *o, int action, uint16_t worker,
                         uint32_t slot, uint8_t version) {
    o->action = action, o->to_worker = worker;
    pack_header(o->header, GS_RESULT, p->job, worker, slot, version, r->op, r->flags,
                (uint64_t)r->chunk, r->elements, (uint16_t)r->contributors, p->token);
    o->payload = r->result, o->payload_size = r->result_size;
}

/* -- lane arithmetic ------------------------------------------------------------------------- */

/* lanes packed `bits` wide (bits.py: lane i at bit i*bits, little-endian), as int32 */
static int32_t lane_at(const uint8_t *packed, size_t i, int bits) {
    size_t bit = i * (size_t)bits;
    uint64_t word = 0;
    size_t first = bit / 8, need = (bit % 8 + (size_t)bits + 7) / 8;
    memcpy(&word, packed + first, need);
    return (int32_t)((word >> (bit % 8)) & ((1ull << bits) - 1));
}

/* acc += the n int32 lanes at payload (a received datagram: any alignment). Unsigned adds wrap
   like numpy's int32 add, without C's signed-overflow UB. */
MULTIVERSION static void add_int32_lanes(uint32_t *restrict acc, const uint8_t *restrict payload,
                                         size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint32_t lane;
        memcpy(&lane, payload + 4 * i, 4);
        acc[i] += lane;
    }
}

MULTIVERSION static void max_int32_lanes(int32_t *restrict acc, const uint8_t *restrict payload,
                                         size_t n) {
    for (size_t i = 0; i < n; i++) {
        int32_t lane;
        memcpy(&lane, payload + 4 * i, 4);
        acc[i] = acc[i] > lane ? acc[i] : lane;
    }
}

static void enter_lanes(Pool *p, int32_t *acc, const uint8_t *payload, size_t payload_size,
                        uint32_t n, uint8_t op, int presummed, int first) {
    if (op == OP_MAX || p->is_signed || (presummed && p->out_bits == 32)) {
        /* int32 lanes (length checked) */
        if (first)
            memcpy(acc, payload, 4 * (size_t)n);
        else if (op == OP_MAX)
            max_int32_lanes(acc, payload, n);
        else
            add_int32_lanes((uint32_t *)acc, payload, n);
        return;
    }
    if (!presummed && p->lanes != NULL && p->in_bits <= 8 && 8 % p->in_bits == 0) {
        p->lanes->lookup_accumulate(acc, payload, payload + payload_size, n, p->in_bits,
                                    p->table, first);
        return;
    }
    for (uint32_t i = 0; i < n; i++) { /* presummed sums, or no kernel: plain C */
        int32_t value = presummed ? lane_at(payload, i, p->out_bits)
                                  : p->table[lane_at(payload, i, p->in_bits)];
        acc[i] = first ? value : (int32_t)((uint32_t)acc[i] + (uint32_t)value);
    }
}

static void finish(Pool *p, Round *r, int32_t *acc, uint8_t *packed) {
    if (r->op == OP_MAX || p->out_bits == 32) {
        r->result = (uint8_t *)acc, r->result_size = 4 * (size_t)r->elements;
        return;
    }
    size_t size = packed_nbytes(r->elements, p->out_bits);
    if (p->lanes != NULL && p->out_bits <= 16) {
        p->lanes->pack_int32(acc, r->elements, p->out_bits, packed, packed + size);
    } else {
        memset(packed, 0, size);
        for (uint32_t i = 0; i < r->elements; i++) {
            size_t bit = (size_t)i * p->out_bits;
            uint64_t value = (uint32_t)acc[i] & ((1ull << p->out_bits) - 1), word = 0;
            size_t need = (bit % 8 + (size_t)p->out_bits + 7) / 8;
            memcpy(&word, packed + bit / 8, need);
            word |= value << (bit % 8);
            memcpy(packed + bit / 8, &word, need);
        }
    }
    r->result = packed, r->result_size = size;
}

/* -- the state machine (slots.py's SlotPool.on_data) ----------------------------------------- */

static void on_data(Pool *p, const struct gs_header *h, const uint8_t *payload, size_t size,
                    struct outcome *o) {
    o->action = o->stored = o->counter = 0, o->to_worker = 0;
    o->payload = NULL, o->payload_size = 0;
    uint32_t s = p->slots;
    if (h->token != p->token) return drop(p, o, C_BAD_TOKEN); /* not the job's: a spoof */
    if (h->slot >= s) return drop(p, o, C_BAD_SLOT);
    if (h->chunk % (2 * (uint64_t)s) != h->slot + (uint64_t)h->version * s)
        return drop(p, o, C_BAD_CHUNK);
    if (h->elements < 1 || h->elements > p->elements) return drop(p, o, C_BAD_ELEMENTS);
    /* a worker's own packet carries 1; a partial sum (PRESUMMED) leaves 1 for each other */
    int presummed = h->flags & PRESUMMED;
    uint32_t most = presummed ? p->max_contributors - (p->workers - 1) : 1;
    if (h->contributors < 1 || h->contributors > most) return drop(p, o, C_BAD_CONTRIBUTORS);
    if (h->flags & PARTIAL) return drop(p, o, C_BAD_FLAGS);
    if (h->op != OP_SUM && h->op != OP_MAX) return drop(p, o, C_BAD_OP);
    int bits = h->op == OP_MAX ? 32 : presummed ? p->out_bits : p->in_bits;
    if (size != packed_nbytes(h->elements, bits)) return drop(p, o, C_WRONG_LENGTH);
    if (presummed && h->op == OP_SUM && !p->is_signed) { /* else the sum could pass out_bits */
        int64_t bound = (int64_t)p->max_lane * h->contributors;
        for (uint32_t i = 0; i < h->elements; i++)
            if (lane_at(payload, i, p->out_bits) > bound) return drop(p, o, C_OVERFLOW);
    }

    size_t at = (size_t)h->version * s + h->slot;
    Round *r = p->rounds + at;
    uint8_t *seen = p->seen + at * p->workers;
    int64_t chunk = (int64_t)h->chunk;
    if (h->chunk > INT64_MAX) return drop(p, o, C_OUT_OF_STEP); /* can never open a round */
    if (chunk < r->chunk) {
        p->counts[C_STALE]++;
        o->action = SEND_STALE, o->to_worker = h->worker;
        pack_header(o->header, GS_STALE, p->job, h->worker, h->slot, h->version, h->op, 0,
                    h->chunk, 0, 0, p->token);
        return;
    }
    if (chunk > r->chunk) {
        int may = r->state == EMPTY ? chunk == (int64_t)(h->slot + (uint64_t)h->version * s)
                                    : r->state == COMPLETE && chunk == r->chunk + 2 * (int64_t)s;
        if (!may) return drop(p, o, C_OUT_OF_STEP);
        r->state = OPEN, r->chunk = chunk, r->op = h->op, r->elements = h->elements;
        r->arrivals = r->contributors = 0, r->flags = 0;
        r->result = NULL, r->result_size = 0;
        memset(seen, 0, p->workers);
    }
    if (h->op != r->op || h->elements != r->elements) return drop(p, o, C_MISMATCH);
    if (seen[h->worker]) {
        if (r->state != COMPLETE) return drop(p, o, C_DUPLICATE);
        p->counts[C_ANSWERED]++;
        return reply_result(p, r, o, SEND_UNICAST, h->worker, h->slot, h->version);
    }
    seen[h->worker] = 1;
    if (r->state == COMPLETE) { /* a straggler of a partial round (never without a quorum) */
        p->counts[C_LATE]++;
        return reply_result(p, r, o, SEND_UNICAST, h->worker, h->slot, h->version);
    }
    /* every worker still to come adds at least one: no room for them would wedge the round */
    if (r->contributors + h->contributors + (p->workers - r->arrivals - 1) > p->max_contributors) {
        seen[h->worker] = 0;
        return drop(p, o, C_TOO_MANY);
    }
    int32_t *acc = p->acc + at * p->elements;
    enter_lanes(p, acc, payload, size, h->elements, h->op, presummed, r->arrivals == 0);
    r->arrivals++;
    r->contributors += h->contributors;
    p->counts[C_STORED]++;
    o->stored = 1;
    if (r->arrivals < p->workers) return;
    finish(p, r, acc, p->packed + at * p->packed_stride);
    r->state = COMPLETE;
    p->counts[C_COMPLETED]++;
    p->counts[C_MULTICASTS]++;
    reply_result(p, r, o, SEND_MULTICAST, ANY_WORKER, h->slot, h->version);
}

/* -- the Pool type --------------------------------------------------------------------------- */

static int address_of(PyObject *item, struct sockaddr_in *out) {
    const char *host;
    int port;
    if (!PyArg_ParseTuple(item, "si", &host, &port)) return 0;
    memset(out, 0, sizeof *out);
    out->sin_family = AF_INET;
    out->sin_port = htons((uint16_t)port);
    if (port < 0 || port > 65535 || inet_pton(AF_INET, host, &out->sin_addr) != 1) {
        PyErr_Format(PyExc_ValueError, "%s:%d is not an IPv4 address", host, port);
        return 0;
    }
    return 1;
}

static const struct thc_lane_api *lane_kernels(void) {
    const struct thc_lane_api *api = PyCapsule_Import(THC_LANE_API_CAPSULE, 0);
    if (api == NULL) PyErr_Clear(); /* built without the THC kernels: plain C */
    return api;
}

static void Pool_dealloc(Pool *p) {
    PyMem_Free(p->addresses);
    if (p->acc_view.obj != NULL) PyBuffer_Release(&p->acc_view);
    PyMem_Free(p->packed);
    PyMem_Free(p->seen);
    PyMem_Free(p->rounds);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

static void *resident(size_t size) {
    void *memory = PyMem_Malloc(size);
    if (memory != NULL) memset(memory, 0, size);
    return memory;
}

/* Pool(job, slots, elements, max_contributors, in_bits, out_bits, signed, table, addresses,
        group, use_kernels, acc, token): acc a writable C-contiguous int32 buffer of
        2*slots*elements; token the job's data token */
static int Pool_init(Pool *p, PyObject *args, PyObject *kw) {
    int job, is_signed, use_kernels;
    unsigned slots, elements, max_contributors;
    int in_bits, out_bits;
    PyObject *table, *addresses, *group, *acc;
    unsigned long long token;
    if (!PyArg_ParseTuple(args, "iIIIiipOOOpOK", &job, &slots, &elements, &max_contributors,
                          &in_bits, &out_bits, &is_signed, &table, &addresses, &group,
                          &use_kernels, &acc, &token))
        return -1;
    if (p->rounds != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a Pool is initialised once");
        return -1;
    }
    Py_ssize_t workers = PySequence_Length(addresses);
    int narrow = !is_signed;
    if (workers < 1 || slots < 1 || elements < 1 || job < 0 || job > 0xFFFF ||
        (is_signed && (in_bits != 32 || out_bits != 32)) ||
        (narrow && (in_bits < 1 || in_bits > 8 || out_bits < 1 || out_bits > 31))) {
        PyErr_SetString(PyExc_ValueError, "a native pool takes int32 sums or narrow lanes");
        return -1;
    }
    p->job = (uint16_t)job, p->workers = (uint32_t)workers, p->slots = slots;
    p->token = (uint64_t)token;
    p->elements = elements, p->max_contributors = max_contributors;
    p->in_bits = in_bits, p->out_bits = out_bits, p->is_signed = is_signed;
    if (narrow) {
        Py_ssize_t entries = PySequence_Length(table);
        if (entries != (Py_ssize_t)1 << in_bits) {
            PyErr_SetString(PyExc_ValueError, "the table needs 2**in_bits entries");
            return -1;
        }
        for (Py_ssize_t k = 0; k < entries; k++) {
            PyObject *item = PySequence_GetItem(table, k);
            long value = item == NULL ? -1 : PyLong_AsLong(item);
            Py_XDECREF(item);
            if (value < 0 || value > INT32_MAX) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "bad table entry");
                return -1;
            }
            p->table[k] = (int32_t)value;
            if ((int32_t)value > p->max_lane) p->max_lane = (int32_t)value;
        }
    }
    size_t rounds = 2 * (size_t)slots;
    p->packed_stride = narrow ? packed_nbytes(elements, out_bits) + 8 : 0;
    p->addresses = PyMem_Calloc((size_t)workers, sizeof *p->addresses);
    if (PyObject_GetBuffer(acc, &p->acc_view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if ((size_t)p->acc_view.len != rounds * elements * sizeof *p->acc) {
        PyErr_SetString(PyExc_ValueError, "acc must hold 2 * slots * elements int32");
        return -1;
    }
    p->acc = p->acc_view.buf;
    /* written now, so the job's memory is resident from its registration (admission counts
       it, native_pool.py's memory) rather than as slots are first used */
    p->packed = resident(rounds * p->packed_stride + 1);
    p->seen = resident(rounds * (size_t)workers);
    p->rounds = PyMem_Calloc(rounds, sizeof *p->rounds);
    if (!p->addresses || !p->packed || !p->seen || !p->rounds) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < rounds; i++) p->rounds[i].chunk = -1;
    for (Py_ssize_t w = 0; w < workers; w++) {
        PyObject *item = PySequence_GetItem(addresses, w);
        int ok = item != NULL && address_of(item, p->addresses + w);
        Py_XDECREF(item);
        if (!ok) return -1;
    }
    p->has_group = group != Py_None;
    if (p->has_group && !address_of(group, &p->group)) return -1;
    p->lanes = use_kernels ? lane_kernels() : NULL;
    return 0;
}

static PyObject *outcome_tuple(const struct outcome *o) {
    if (o->action == DROP)
        return Py_BuildValue("(iis)", o->stored, DROP, counter_names[o->counter] + 8);
    if (o->action == 0) return Py_BuildValue("(iiO)", o->stored, 0, Py_None);
    return Py_BuildValue("(iiiy#y#)", o->stored, o->action, (int)o->to_worker,
                         (const char *)o->header, (Py_ssize_t)HEADER_SIZE,
                         (const char *)(o->payload ? o->payload : (const uint8_t *)""),
                         (Py_ssize_t)o->payload_size);
}

static PyObject *Pool_process(Pool *p, PyObject *args) {
    unsigned worker, slot, version, op, flags, elements, contributors;
    unsigned long long chunk, token;
    Py_buffer payload;
    if (!PyArg_ParseTuple(args, "IIIIIKIIy*K", &worker, &slot, &version, &op, &flags, &chunk,
                          &elements, &contributors, &payload, &token))
        return NULL;
    if (worker >= p->workers || version > 1 || op > 0xFF || flags > 0xFF ||
        contributors > 0xFFFF) {
        PyBuffer_Release(&payload);
        PyErr_SetString(PyExc_ValueError, "fields the caller should have checked");
        return NULL;
    }
    struct gs_header h = {.kind = GS_DATA, .version = (uint8_t)version, .op = (uint8_t)op,
                          .flags = (uint8_t)flags, .job = p->job, .worker = (uint16_t)worker,
                          .contributors = (uint16_t)contributors, .slot = slot,
                          .elements = elements, .chunk = chunk, .token = token};
    struct outcome o;
    on_data(p, &h, payload.buf, (size_t)payload.len, &o);
    PyBuffer_Release(&payload);
    return outcome_tuple(&o);
}

static PyObject *Pool_stats(Pool *p, PyObject *unused) {
    PyObject *stats = PyDict_New();
    for (int c = 0; stats != NULL && c < NCOUNTERS; c++) {
        if (!p->counts[c]) continue;
        PyObject *value = PyLong_FromLongLong(p->counts[c]);
        if (value == NULL || PyDict_SetItemString(stats, counter_names[c], value) < 0) Py_CLEAR(stats);
        Py_XDECREF(value);
    }
    return stats;
}

/* every byte of slot state (accumulators, seen bytes, round fields): tests compare snapshots */
static PyObject *Pool_snapshot(Pool *p, PyObject *unused) {
    size_t rounds = 2 * (size_t)p->slots;
    size_t acc = rounds * p->elements * sizeof *p->acc, seen = rounds * p->workers;
    size_t fields = sizeof(int64_t) + 3 + 3 * sizeof(uint32_t);
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(acc + seen + rounds * fields));
    if (out == NULL) return NULL;
    char *at = PyBytes_AS_STRING(out);
    memcpy(at, p->acc, acc), at += acc;
    memcpy(at, p->seen, seen), at += seen;
    for (size_t i = 0; i < rounds; i++) {
        const Round *r = p->rounds + i;
        memcpy(at, &r->chunk, 8), at += 8;
        *at++ = (char)r->state, *at++ = (char)r->op, *at++ = (char)r->flags;
        memcpy(at, &r->elements, 4), at += 4;
        memcpy(at, &r->arrivals, 4), at += 4;
        memcpy(at, &r->contributors, 4), at += 4;
    }
    return out;
}

static PyObject *Pool_uses_kernels(Pool *p, PyObject *unused) {
    return PyBool_FromLong(p->lanes != NULL);
}

static PyMethodDef Pool_methods[] = {
    {"process", (PyCFunction)Pool_process, METH_VARARGS,
     "process(worker, slot, version, op, flags, chunk, elements, contributors, payload, token)"},
    {"stats", (PyCFunction)Pool_stats, METH_NOARGS, "the counters slots.py would hold"},
    {"uses_kernels", (PyCFunction)Pool_uses_kernels, METH_NOARGS, "THC's lane kernels in use"},
    {"snapshot", (PyCFunction)Pool_snapshot, METH_NOARGS, "all slot state, as bytes"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gradsum.dataplane._pool.Pool",
    .tp_basicsize = sizeof(Pool),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Pool_init,
    .tp_dealloc = (destructor)Pool_dealloc,
    .tp_methods = Pool_methods,
    .tp_doc = "An integer-sum job's slot pool (see native_pool.py).",
};

/* -- the daemon loop ------------------------------------------------------------------------- */

/* seeded loss injection (--drop-rate): xorshift64* draws in [0, 1) */
struct loss {
    double in, out;
    uint64_t *state;
    long long dropped_in, dropped_out;
};

static int lost(struct loss *l, double rate) {
    if (rate <= 0) return 0;
    uint64_t x = *l->state;
    x ^= x >> 12, x ^= x << 25, x ^= x >> 27;
    *l->state = x;
    return (double)((x * 0x2545F4914F6CDD1Dull) >> 11) * 0x1.0p-53 < rate;
}

/* Results wait in a queue until the socket is drained (or the queue is full), so that runs of
 * them to one address, of one size, leave in one system call with UDP_SEGMENT (GSO): a worker's
 * chunk of MTU-sized packets (net/pump.py) completes as such a run. Payloads stay valid while
 * queued: they live in their round's slot memory, which no packet can reuse before the workers
 * have these results. */
#define MAX_QUEUE 64

struct queued {
    struct sockaddr_in to;
    uint8_t header[HEADER_SIZE];
    const uint8_t *payload;
    size_t payload_size;
};

struct send_queue {
    int fd, count, gso_works;
    long long sent, failures;
    struct queued items[MAX_QUEUE];
    struct iovec parts[2 * MAX_QUEUE];
};

static int send_message(int fd, struct msghdr *message) {
    for (int attempt = 0; attempt < 2; attempt++) {
        if (sendmsg(fd, message, 0) >= 0) return 1;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return 0; /* the worker's timer recovers */
        if (attempt == 0) {
            struct pollfd writable = {fd, POLLOUT, 0};
            poll(&writable, 1, SEND_WAIT_MS);
        }
    }
    return 0;
}

static int same_address(const struct queued *a, const struct queued *b) {
    return a->to.sin_addr.s_addr == b->to.sin_addr.s_addr && a->to.sin_port == b->to.sin_port;
}

/* Items [first, first + count) as one GSO message (count > 1) or one datagram. */
static void send_run(struct send_queue *q, int first, int count) {
    for (int i = 0; i < count; i++) {
        struct queued *item = q->items + first + i;
        q->parts[2 * i] = (struct iovec){item->header, HEADER_SIZE};
        q->parts[2 * i + 1] = (struct iovec){(void *)item->payload, item->payload_size};
    }
    struct msghdr message = {.msg_name = &q->items[first].to,
                             .msg_namelen = sizeof q->items[first].to, .msg_iov = q->parts,
                             .msg_iovlen = 2 * (size_t)count};
    union gs_segment_control control;
    if (count > 1)
        gs_set_segments(&message, &control, (uint16_t)(HEADER_SIZE + q->items[first].payload_size));
    if (send_message(q->fd, &message)) {
        q->sent += count;
        return;
    }
    if (count > 1 && gs_gso_refused(errno)) {
        q->gso_works = 0; /* refused here (old kernel, a device without it): one by one */
        for (int i = 0; i < count; i++) send_run(q, first + i, 1);
        return;
    }
    q->failures += count;
}

static void flush(struct send_queue *q) {
    int first = 0;
    while (first < q->count) {
        int count = 1;
        size_t packet = HEADER_SIZE + q->items[first].payload_size;
        /* a run: same address and size; the last item may be shorter (a stream's last packet) */
        while (q->gso_works && first + count < q->count &&
               (size_t)(count + 1) * packet <= GS_MAX_GSO_BYTES) {
            const struct queued *head = q->items + first, *next = head + count;
            if (!same_address(head, next) || next->payload_size > head->payload_size) break;
            count++;
            if (next->payload_size < head->payload_size) break; /* a shorter one ends a run */
        }
        send_run(q, first, count);
        first += count;
    }
    q->count = 0;
}

/* one copy to `to` unless the injected loss takes it */
static void emit(struct send_queue *q, const struct sockaddr_in *to, const struct outcome *o,
                 struct loss *l) {
    if (lost(l, l->out)) {
        l->dropped_out++;
        return;
    }
    if (q->count == MAX_QUEUE) flush(q);
    struct queued *item = q->items + q->count++;
    item->to = *to;
    memcpy(item->header, o->header, HEADER_SIZE);
    item->payload = o->payload, item->payload_size = o->payload_size;
}

static void send_outcome(struct send_queue *q, Pool *p, const struct outcome *o, struct loss *l) {
    if (o->action == SEND_MULTICAST && p->has_group) {
        emit(q, &p->group, o, l);
    } else if (o->action == SEND_MULTICAST) {
        for (uint32_t w = 0; w < p->workers; w++) emit(q, p->addresses + w, o, l);
    } else if (o->action == SEND_UNICAST || o->action == SEND_STALE) {
        emit(q, p->addresses + o->to_worker, o, l);
    }
}

static Pool *pool_for(Pool **pools, Py_ssize_t count, uint16_t job) {
    for (Py_ssize_t i = 0; i < count; i++)
        if (pools[i]->job == job) return pools[i];
    return NULL;
}

#define MAX_POOLS 256

static int gso_works = 1; /* cleared for good by the first refusal */

static PyObject *py_serve(PyObject *self, PyObject *args) {
    int fd, limit;
    PyObject *sequence;
    Py_buffer buffer, rng;
    struct loss loss = {0};
    if (!PyArg_ParseTuple(args, "iOw*iddw*", &fd, &sequence, &buffer, &limit, &loss.in,
                          &loss.out, &rng))
        return NULL;
    if (rng.len != sizeof(uint64_t)) {
        PyBuffer_Release(&rng);
        PyBuffer_Release(&buffer);
        PyErr_SetString(PyExc_ValueError, "the loss state is one uint64");
        return NULL;
    }
    loss.state = rng.buf;
    PyObject *fast = PySequence_Fast(sequence, "pools must be a sequence of Pool");
    if (fast == NULL || buffer.len < MAX_DATAGRAM + 1) {
        if (fast != NULL) PyErr_SetString(PyExc_ValueError, "the buffer must hold a datagram");
        Py_XDECREF(fast);
        PyBuffer_Release(&buffer);
        PyBuffer_Release(&rng);
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(fast);
    Pool *pools[MAX_POOLS];
    for (Py_ssize_t i = 0; i < count && i < MAX_POOLS; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
        if (!PyObject_TypeCheck(item, &PoolType)) {
            PyErr_SetString(PyExc_TypeError, "pools must be a sequence of Pool");
            Py_DECREF(fast);
            PyBuffer_Release(&buffer);
            PyBuffer_Release(&rng);
            return NULL;
        }
        pools[i] = (Pool *)item;
    }
    if (count > MAX_POOLS) count = MAX_POOLS;
    uint8_t *data = buffer.buf;
    long long handled = 0;
    struct send_queue *queue = PyMem_RawMalloc(sizeof *queue);
    if (queue == NULL) {
        Py_DECREF(fast);
        PyBuffer_Release(&buffer);
        PyBuffer_Release(&rng);
        return PyErr_NoMemory();
    }
    queue->fd = fd, queue->count = 0, queue->gso_works = gso_works;
    queue->sent = queue->failures = 0;
    ssize_t size = 0;
    struct sockaddr_in source;
    int error = 0;
    Py_BEGIN_ALLOW_THREADS
    while (handled < limit) {
        union gs_gro_control control;
        struct iovec whole = {data, MAX_DATAGRAM + 1};
        struct msghdr message = {.msg_name = &source, .msg_namelen = sizeof source,
                                 .msg_iov = &whole, .msg_iovlen = 1,
                                 .msg_control = control.buf, .msg_controllen = sizeof control.buf};
        ssize_t total = recvmsg(fd, &message, MSG_DONTWAIT);
        if (total < 0) {
            if (errno == ECONNREFUSED || errno == EINTR) continue;
            error = errno == EAGAIN || errno == EWOULDBLOCK ? 0 : errno;
            break;
        }
        /* several datagrams of one sender when UDP_GRO joined them: `segment` bytes each, the
           last maybe shorter */
        size_t segment = gs_gro_segment(&message, (size_t)total);
        size_t datagrams = total == 0 ? 1 : ((size_t)total + segment - 1) / segment;
        for (size_t i = 0, at = 0; i < datagrams; i++, at += segment) {
            size_t length = (size_t)total - at < segment ? (size_t)total - at : segment;
            if (lost(&loss, loss.in)) {
                loss.dropped_in++;
                continue;
            }
            const uint8_t *packet = data + at;
            struct gs_header h;
            Pool *p = NULL;
            if (source.sin_family == AF_INET && parse(packet, length, &h))
                p = pool_for(pools, count, h.job);
            if (p == NULL || h.worker >= p->workers ||
                p->addresses[h.worker].sin_addr.s_addr != source.sin_addr.s_addr ||
                p->addresses[h.worker].sin_port != source.sin_port) {
                /* Python's: it drops and counts what is wrong, or it is control. Datagrams
                   joined after it are dropped with it (only a broken sender joins such). */
                memmove(data, packet, length);
                size = (ssize_t)length;
                break;
            }
            struct outcome o;
            on_data(p, &h, packet + HEADER_SIZE, length - HEADER_SIZE, &o);
            send_outcome(queue, p, &o, &loss);
            handled++;
        }
        if (size) break;
    }
    flush(queue); /* before Python handles what it was left, in order */
    Py_END_ALLOW_THREADS
    gso_works = queue->gso_works;
    long long sent = queue->sent, failures = queue->failures;
    PyMem_RawFree(queue);
    Py_DECREF(fast);
    PyBuffer_Release(&buffer);
    PyBuffer_Release(&rng);
    if (error) {
        errno = error;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (size == 0)
        return Py_BuildValue("(LLLLLnO)", handled, sent, failures, loss.dropped_in,
                             loss.dropped_out, (Py_ssize_t)0, Py_None);
    char host[INET_ADDRSTRLEN] = "";
    PyObject *where = NULL;
    if (source.sin_family == AF_INET) {
        inet_ntop(AF_INET, &source.sin_addr, host, sizeof host);
        where = Py_BuildValue("(si)", host, (int)ntohs(source.sin_port));
    } else {
        where = Py_BuildValue("(si)", "", 0); /* not IPv4: no job's worker */
    }
    if (where == NULL) return NULL;
    return Py_BuildValue("(LLLLLnN)", handled, sent, failures, loss.dropped_in, loss.dropped_out,
                         (Py_ssize_t)size, where);
}

static PyMethodDef methods[] = {
    {"serve", py_serve, METH_VARARGS,
     "serve(fd, pools, buffer, limit, drop_in, drop_out, rng) -> (handled, sent, send_failures,"
     " dropped_in, dropped_out, size, source)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pool",
                                    "Integer-sum slot pools in C (see native_pool.py).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__pool(void) {
    if (PyType_Ready(&PoolType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&PoolType);
    if (PyModule_AddObject(m, "Pool", (PyObject *)&PoolType) < 0) {
        Py_DECREF(&PoolType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "ROUND_BYTES", (long)sizeof(Round)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
