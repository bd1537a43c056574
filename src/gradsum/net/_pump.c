/* The worker's packet pump: the per-datagram system calls and checks of net/client.py in C.
 *
 * The Python transport keeps every decision (dataplane/worker.py's ChunkStream: what to send,
 * when to resend, when a round is done); this module only moves datagrams, in batches, with the
 * GIL released:
 *
 *   receive(fds, routes, wait_ms, max_events) -> [(route, chunk, contributors, flags, event)]
 *     Drains queued datagrams from the sockets (waiting up to wait_ms when none is queued). A
 *     RESULT that route r expects (source, job, op, chunk in range and not yet placed, lane
 *     count, contributors, payload size: dataplane/transfer.py's checks) is received straight
 *     into its place in the route's result buffer; a repeat of a placed chunk or a STALE notice
 *     becomes an event; anything else is read and dropped, as the Python path does.
 *   send(fd, routes, [(route, chunk), ...]) -> chunks sent
 *     Builds each packet's header (dataplane/packet.py's layout) and sends header + the
 *     packet's slice of the route's upstream buffer gathered, with sendmmsg. A chunk of several
 *     packets (a route's `segments`) goes as one message with UDP_SEGMENT (GSO): the kernel cuts
 *     it into the datagrams, so a window of MTU-sized packets costs one call per chunk. Where
 *     GSO is refused (old kernel, a device without it), its packets go one by one from then on.
 *
 * A route may also code its lanes (``codec``: bfp, codecs/bfp_core.h): each packet is then encoded
 * from the round's float input as it is sent, into a small staging area the kernel copies from
 * while it is still in cache, and each result is decoded from where it landed straight into the
 * round's float output; neither the upstream nor the result buffer is touched. Encoding is a
 * function of the input alone, so a resent packet carries the same bits.
 *
 * Chunks are the transfer's (dataplane/transfer.py); the aggregator sees packets: chunk c of a
 * route is packets base + (c - first) * segments + i, i < segments, in slots * segments slots.
 * A result is placed per packet; the chunk is reported PLACED once all its packets are, and
 * each packet before that PROGRESS, or HOLES for its last packet (the missing ones were lost).
 *
 * ``routes`` is a contiguous array of struct route (its numpy twin is ROUTE in net/pump.py);
 * the buffers it points to belong to the caller, who keeps them alive across the calls.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>


#include "../codecs/bfp_core.h"
#include "../dataplane/header.h"
#include "udp_offload.h"

#define HEADER_SIZE GS_HEADER_SIZE
#define MAX_FDS 16
#define MAX_BATCH 64
#define MAX_SEGMENTS 64 /* packets per GSO send (the kernel's UDP_MAX_SEGMENTS is 64 or 128) */
#define SEND_WAIT_MS 20 /* how long a full send buffer may stall one batch (client.py's too) */
#define STAGE_BYTES (256 << 10) /* coded packets of one batch: stays in L2 until it is sent */

/* PROGRESS: a packet of a chunk placed, the chunk still incomplete (loss detection counts it);
   HOLES: the chunk's last packet placed while earlier ones are still missing. A chunk's results
   come back in packet order (each worker sends its packets in order, a slot completes with the
   last worker's), so those were lost: a packet or its result. */
enum event { PLACED = 1, REPEAT = 2, STALE = 3, PROGRESS = 4, HOLES = 5 };

struct route {             /* one transfer: an aggregator job streaming one buffer */
    uint32_t ip;           /* the aggregator, network order */
    uint16_t port;         /* network order */
    uint16_t job;
    uint16_t worker;
    uint8_t op;
    uint8_t in_bits;
    uint8_t out_bits;
    uint8_t pad[3];
    uint32_t max_contributors;
    int64_t first;         /* first chunk id */
    int64_t count;         /* chunks */
    int64_t lanes;
    int64_t slots;         /* the aggregator's: slots of the window * segments */
    int64_t base;          /* first packet id */
    int64_t segments;      /* packets per chunk */
    int64_t packet_lanes;
    int64_t packets;
    uint64_t upstream;     /* address of the packed lanes to send */
    uint64_t downstream;   /* address of the result buffer */
    uint64_t placed;       /* address of uint8[packets]: 1 once a packet's result is in place */
    uint64_t token;        /* the job's data token, sent in and expected on every packet */
    /* codec CODEC_BFP: the packets' lanes are coded here (bfp_native.LaneCoder's fields) */
    uint64_t source;       /* const float *: the round's input at the phase's lane 0 */
    uint64_t target;       /* float *: the round's output, likewise */
    uint64_t exponents;    /* const float *: one per block, blocks from the phase's lane 0 */
    int64_t lane0;         /* the route's first lane within the phase */
    int64_t coordinates;   /* the phase's coordinates: lanes past them are padding (zeros) */
    int64_t block;
    float limit;
    uint8_t codec;
    uint8_t headroom;
    uint8_t pad2[2];
};

enum codec { CODEC_NONE = 0, CODEC_BFP = 1 };

static void pack(uint8_t *b, const struct route *r, int64_t chunk, uint32_t elements) {
    struct gs_header h = {.kind = GS_DATA, .version = (uint8_t)((chunk / r->slots) % 2),
                          .op = r->op, .job = r->job, .worker = r->worker, .contributors = 1,
                          .slot = (uint32_t)(chunk % r->slots), .elements = elements,
                          .chunk = (uint64_t)chunk, .token = r->token};
    gs_pack(b, &h);
}

/* ChunkLayout at packet granularity: lanes of packet `index` and their byte range */
static int64_t lanes_of(const struct route *r, int64_t index) {
    int64_t start = index * r->packet_lanes, left = r->lanes - start;
    return left < r->packet_lanes ? left : r->packet_lanes;
}

static void byte_range(const struct route *r, int64_t index, int bits, int64_t *start,
                       int64_t *stop) {
    int64_t first = index * r->packet_lanes;
    *start = first * bits / 8;
    *stop = (first * bits + lanes_of(r, index) * bits + 7) / 8;
}

/* the packets [*from, *to) of the route's chunk `index` */
static void packets_of(const struct route *r, int64_t index, int64_t *from, int64_t *to) {
    *from = index * r->segments;
    *to = *from + r->segments < r->packets ? *from + r->segments : r->packets;
}

static int chunk_placed(const struct route *r, int64_t index) {
    const uint8_t *placed = (const uint8_t *)(uintptr_t)r->placed;
    int64_t from, to;
    packets_of(r, index, &from, &to);
    for (int64_t p = from; p < to; p++)
        if (!placed[p]) return 0;
    return 1;
}

/* Lanes [first, first + n) of route r's phase that are coordinates (the rest are padding). */
static int64_t real_lanes(const struct route *r, int64_t first, int64_t n) {
    int64_t left = r->coordinates - first;
    return left <= 0 ? 0 : left < n ? left : n;
}

/* Packet `packet`'s lanes, encoded into `out` (its in_bits bytes). */
static void encode_packet(const struct route *r, int64_t packet, uint8_t *out) {
    int64_t first = r->lane0 + packet * r->packet_lanes, n = lanes_of(r, packet);
    int64_t real = real_lanes(r, first, n);
    if (real > 0) /* finiteness: the round's summary pass has checked these coordinates */
        bfp_encode((const float *)(uintptr_t)r->source, (size_t)first, (size_t)real,
                   (size_t)r->block, (const float *)(uintptr_t)r->exponents, r->headroom,
                   r->limit, (int32_t *)out);
    memset(out + real * 4, 0, (size_t)(n - real) * 4);
}

/* A result of packet `packet` (its out_bits bytes at `data`), decoded into the round's output. */
static void decode_packet(const struct route *r, int64_t packet, const uint8_t *data,
                          int contributors) {
    int64_t first = r->lane0 + packet * r->packet_lanes;
    int64_t real = real_lanes(r, first, lanes_of(r, packet));
    if (real > 0)
        bfp_decode((const int32_t *)data, (size_t)first, (size_t)real, (size_t)r->block,
                   (const float *)(uintptr_t)r->exponents, r->headroom, contributors,
                   (float *)(uintptr_t)r->target);
}

struct found {
    int64_t route, chunk;
    uint16_t contributors;
    uint8_t flags, event;
};


static const struct route *route_of(const struct route *routes, Py_ssize_t nroutes,
                                    const struct sockaddr_in *source, uint16_t job,
                                    Py_ssize_t *which) {
    for (*which = 0; *which < nroutes; ++*which) {
        const struct route *c = routes + *which;
        if (c->ip == source->sin_addr.s_addr && c->port == source->sin_port && c->job == job)
            return c;
    }
    return NULL;
}

/* Where packet `packet` of route `r`, `payload` bytes, belongs: its place in the result buffer
   if it is the route's, expected and of that size, else NULL. */
static uint8_t *place_of(const struct route *r, int64_t packet, size_t payload) {
    if (packet < 0 || packet >= r->packets || ((const uint8_t *)(uintptr_t)r->placed)[packet])
        return NULL;
    int64_t start, stop;
    byte_range(r, packet, r->out_bits, &start, &stop);
    return (size_t)(stop - start) == payload ? (uint8_t *)(uintptr_t)r->downstream + start : NULL;
}

/* A received result header against what route r expects of packet `packet`. */
static int expected(const struct route *r, const struct gs_header *h, int64_t packet) {
    return h->kind == GS_RESULT && h->op == r->op && h->token == r->token &&
           h->chunk == (uint64_t)(r->base + packet) &&
           h->elements == lanes_of(r, packet) && h->contributors >= 1 &&
           h->contributors <= r->max_contributors;
}

static void add_event(struct found *events, int *nevents, Py_ssize_t route, int64_t chunk,
                      const struct gs_header *h, int event) {
    events[(*nevents)++] = (struct found){.route = route, .chunk = chunk,
                                          .contributors = h->contributors, .flags = h->flags,
                                          .event = (uint8_t)event};
}

/* Where payloads without a predicted place land: datagram i of a read at i * its size. */
static __thread uint8_t sink[1 << 16];

/* Handle the read at the head of `fd`: one datagram, or up to MAX_SEGMENTS of one sender that
   UDP_GRO joined (a run of results the switch sent in one GSO message). Results land straight in
   their places: the first header names the packet, the rest are predicted to follow it and
   checked after the read. A run of other packets (answers to resends, say) lands elsewhere: a
   result that is still expected is then copied to its place (staged through the sink first, as
   its landing place may be another's target); what it overwrote was a place still waiting. At
   most one event per datagram. A coded route's results all land in the sink and are decoded
   from there into the round's output. Returns 1 if something was read, 0 when the socket is
   empty, -1 on an error (errno). */
static int take_one(int fd, const struct route *routes, Py_ssize_t nroutes,
                    struct found *events, int *nevents) {
    uint8_t heads[MAX_SEGMENTS][HEADER_SIZE];
    struct sockaddr_in source;
    union gs_gro_control control;
    struct iovec peek = {heads[0], HEADER_SIZE};
    struct msghdr message = {.msg_name = &source, .msg_namelen = sizeof source, .msg_iov = &peek,
                             .msg_iovlen = 1, .msg_control = control.buf,
                             .msg_controllen = sizeof control.buf};
    ssize_t size = recvmsg(fd, &message, MSG_PEEK | MSG_TRUNC | MSG_DONTWAIT);
    if (size < 0) return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -1;
    size_t segment = gs_gro_segment(&message, (size_t)size);
    int count = size == 0 ? 1 : (int)(((size_t)size + segment - 1) / segment);
    struct gs_header first;
    const struct route *r = NULL;
    Py_ssize_t which = 0;
    size_t last = (size_t)size - (size_t)(count - 1) * segment; /* the last datagram's size */
    if (count <= MAX_SEGMENTS && last >= HEADER_SIZE && segment >= HEADER_SIZE &&
        source.sin_family == AF_INET && gs_parse(heads[0], &first))
        r = route_of(routes, nroutes, &source, first.job, &which);
    if (r == NULL || (first.kind != GS_RESULT && first.kind != GS_STALE) || first.op != r->op ||
        first.token != r->token ||
        first.chunk < (uint64_t)r->base || first.chunk >= (uint64_t)(r->base + r->packets)) {
        uint8_t scrap[1]; /* not ours, or not as expected: read it and let it go */
        recv(fd, scrap, sizeof scrap, MSG_DONTWAIT | MSG_TRUNC);
        return 1;
    }
    int64_t packet = (int64_t)(first.chunk - (uint64_t)r->base);
    int coded = r->codec != CODEC_NONE; /* decoded from the sink, never placed as lanes */
    struct iovec parts[2 * MAX_SEGMENTS];
    uint8_t *places[MAX_SEGMENTS];
    size_t payloads[MAX_SEGMENTS];
    for (int i = 0; i < count; i++) {
        size_t length = (size_t)size - (size_t)i * segment;
        payloads[i] = (length < segment ? length : segment) - HEADER_SIZE;
        /* the first header is known before the read: a place only for what it promises */
        int wanted = i > 0 ? first.kind == GS_RESULT : expected(r, &first, packet);
        places[i] = wanted && !coded ? place_of(r, packet + i, payloads[i]) : NULL;
        uint8_t *landing = places[i] ? places[i] : sink + (size_t)i * segment;
        parts[2 * i] = (struct iovec){heads[i], HEADER_SIZE};
        parts[2 * i + 1] = (struct iovec){landing, payloads[i]};
    }
    struct msghdr whole = {.msg_iov = parts, .msg_iovlen = 2 * (size_t)count};
    ssize_t got = recvmsg(fd, &whole, MSG_DONTWAIT);
    if (got != size || (whole.msg_flags & MSG_TRUNC)) return 1; /* raced: the timer resends */
    uint8_t *placed = (uint8_t *)(uintptr_t)r->placed;
    struct gs_header h[MAX_SEGMENTS];
    int64_t q[MAX_SEGMENTS]; /* the packet datagram i holds, -1 if none of this route's */
    int moved[MAX_SEGMENTS] = {0};
    for (int i = 0; i < count; i++) {
        q[i] = -1;
        if (gs_parse(heads[i], &h[i]) && h[i].job == r->job && h[i].op == r->op &&
            h[i].token == r->token &&
            h[i].chunk >= (uint64_t)r->base && h[i].chunk < (uint64_t)(r->base + r->packets))
            q[i] = (int64_t)(h[i].chunk - (uint64_t)r->base);
        if (coded || q[i] < 0 || h[i].kind != GS_RESULT || !expected(r, &h[i], q[i])) continue;
        if (places[i] != NULL && q[i] == packet + i) continue; /* where it belongs */
        if (place_of(r, q[i], payloads[i]) == NULL) continue; /* placed already, or misfit */
        moved[i] = 1;
        if (places[i] != NULL) /* stage it: its landing place may be another's target */
            memcpy(sink + (size_t)i * segment, places[i], payloads[i]);
    }
    int placed_by[MAX_SEGMENTS]; /* 1 where datagram i put packet q[i] in place */
    for (int i = 0; i < count; i++) {
        placed_by[i] = 0;
        if (q[i] < 0) continue;
        int64_t chunk = r->first + q[i] / r->segments;
        if (h[i].kind == GS_STALE) {
            add_event(events, nevents, which, chunk, &h[i], STALE);
        } else if (coded && expected(r, &h[i], q[i]) && place_of(r, q[i], payloads[i])) {
            decode_packet(r, q[i], sink + (size_t)i * segment, h[i].contributors);
            placed[q[i]] = placed_by[i] = 1;
        } else if (moved[i] && !placed[q[i]]) {
            memcpy(place_of(r, q[i], payloads[i]), sink + (size_t)i * segment, payloads[i]);
            placed[q[i]] = placed_by[i] = 1;
        } else if (!moved[i] && places[i] != NULL && q[i] == packet + i &&
                   expected(r, &h[i], q[i]) && !placed[q[i]]) {
            placed[q[i]] = placed_by[i] = 1;
        } else if (h[i].kind == GS_RESULT && placed[q[i]]) {
            add_event(events, nevents, which, chunk, &h[i], REPEAT);
        }
    }
    int64_t reported = -1;
    for (int i = 0; i < count; i++) { /* chunks completed by this read once each, or progress */
        if (!placed_by[i]) continue;
        int64_t chunk = q[i] / r->segments;
        if (chunk == reported) continue;
        int complete = chunk_placed(r, chunk);
        int64_t from, to;
        packets_of(r, chunk, &from, &to);
        int event = complete ? PLACED : q[i] == to - 1 ? HOLES : PROGRESS;
        add_event(events, nevents, which, r->first + chunk, &h[i], event);
        if (complete) reported = chunk;
    }
    return 1;
}

/* ---------------------------------------------------------------------------------------------
 * Python entry points
 */

static int fds_of(PyObject *sequence, int *fds, Py_ssize_t *count) {
    PyObject *fast = PySequence_Fast(sequence, "fds must be a sequence of file descriptors");
    if (fast == NULL) return 0;
    *count = PySequence_Fast_GET_SIZE(fast);
    if (*count < 1 || *count > MAX_FDS) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "between 1 and %d sockets", MAX_FDS);
        return 0;
    }
    for (Py_ssize_t i = 0; i < *count; i++) {
        long fd = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
        if (fd < 0) {
            Py_DECREF(fast);
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a closed socket");
            return 0;
        }
        fds[i] = (int)fd;
    }
    Py_DECREF(fast);
    return 1;
}

static int routes_of(Py_buffer *view, const struct route **routes, Py_ssize_t *count) {
    if (view->len % (Py_ssize_t)sizeof(struct route)) {
        PyErr_Format(PyExc_ValueError, "routes: %zd bytes is not a whole number of %zu-byte routes",
                     view->len, sizeof(struct route));
        return 0;
    }
    *routes = view->buf;
    *count = view->len / (Py_ssize_t)sizeof(struct route);
    for (Py_ssize_t i = 0; i < *count; i++) { /* a coder's fields, before any is used */
        const struct route *r = *routes + i;
        if (r->codec == CODEC_NONE) continue;
        if (r->codec != CODEC_BFP || r->in_bits != 32 || r->out_bits != 32 || r->block < 1 ||
            !r->source || !r->target || !r->exponents || r->lane0 < 0 || r->coordinates < 0 ||
            r->headroom > 31) {
            PyErr_Format(PyExc_ValueError, "route %zd: codec %d with %d/%d-bit lanes, block "
                         "%lld: not a bfp coder of 32-bit lanes", i, r->codec, r->in_bits,
                         r->out_bits, (long long)r->block);
            return 0;
        }
    }
    return 1;
}

/* Drain up to `limit` datagrams from the sockets, in turns; 0 = empty, -1 = error (errno). A
   socket found empty is not asked again in this call: results mostly arrive on one (the
   multicast group's), and asking the other between every two of them cost a system call each. */
static int drain(const int *fds, Py_ssize_t nfds, const struct route *routes, Py_ssize_t nroutes,
                 struct found *events, int limit, int *nevents) {
    /* at most 4 * limit reads, so a flood of strangers' datagrams cannot hold off the timers */
    int empty[MAX_FDS] = {0};
    Py_ssize_t emptied = 0;
    for (int turn = 0, reads = 0; *nevents < limit && emptied < nfds && reads < 4 * limit;
         turn++) {
        Py_ssize_t at = turn % nfds;
        if (empty[at]) continue;
        reads++;
        int taken = take_one(fds[at], routes, nroutes, events, nevents);
        if (taken < 0) {
            if (errno == ECONNREFUSED || errno == EINTR) continue; /* ICMP of an earlier send */
            return -1;
        }
        if (!taken) empty[at] = 1, emptied++;
    }
    return 0;
}

static PyObject *py_receive(PyObject *self, PyObject *args) {
    PyObject *fd_list;
    Py_buffer view;
    int wait_ms, limit;
    if (!PyArg_ParseTuple(args, "Oy*ii", &fd_list, &view, &wait_ms, &limit)) return NULL;
    int fds[MAX_FDS];
    Py_ssize_t nfds, nroutes;
    const struct route *routes;
    struct found events[MAX_BATCH + MAX_SEGMENTS]; /* a read may overshoot the limit */
    if (limit < 1 || limit > MAX_BATCH) limit = MAX_BATCH;
    if (!fds_of(fd_list, fds, &nfds) || !routes_of(&view, &routes, &nroutes)) {
        PyBuffer_Release(&view);
        return NULL;
    }
    int nevents = 0, failed = 0, error = 0;
    Py_BEGIN_ALLOW_THREADS
    failed = drain(fds, nfds, routes, nroutes, events, limit, &nevents);
    if (!failed && nevents == 0 && wait_ms > 0) {
        struct pollfd polls[MAX_FDS];
        for (Py_ssize_t i = 0; i < nfds; i++) polls[i] = (struct pollfd){fds[i], POLLIN, 0};
        if (poll(polls, (nfds_t)nfds, wait_ms) > 0)
            failed = drain(fds, nfds, routes, nroutes, events, limit, &nevents);
    }
    error = errno;
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (failed) {
        errno = error;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    PyObject *list = PyList_New(nevents);
    for (int i = 0; list != NULL && i < nevents; i++) {
        struct found *e = events + i;
        PyObject *item = Py_BuildValue("(nLiii)", (Py_ssize_t)e->route, (long long)e->chunk,
                                       (int)e->contributors, (int)e->flags, (int)e->event);
        if (item == NULL) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, i, item);
    }
    return list;
}

/* Whether GSO sends work here; cleared for good by the first refusal. */
static int gso_works = 1;


/* The datagrams of one GSO message, one by one (after GSO was refused). */
static void send_singly(int fd, const struct msghdr *gso) {
    for (size_t i = 0; i + 1 < gso->msg_iovlen; i += 2) {
        struct msghdr single = {.msg_name = gso->msg_name, .msg_namelen = gso->msg_namelen,
                                .msg_iov = gso->msg_iov + i, .msg_iovlen = 2};
        if (sendmsg(fd, &single, 0) < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            struct pollfd writable = {fd, POLLOUT, 0};
            poll(&writable, 1, SEND_WAIT_MS);
            sendmsg(fd, &single, 0); /* a second refusal is left to the timers */
        }
    }
}

/* Send a batch; returns how many went out (a full buffer waits once, then the rest is left to
   the retransmission timers, as client.py's _send does). */
static int send_batch(int fd, struct mmsghdr *messages, int count) {
    int sent = 0, waited = 0;
    while (sent < count) {
        int n = sendmmsg(fd, messages + sent, (unsigned)(count - sent), 0);
        if (n > 0) {
            sent += n;
            continue;
        }
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && !waited) {
            struct pollfd writable = {fd, POLLOUT, 0};
            poll(&writable, 1, SEND_WAIT_MS);
            waited = 1;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        struct msghdr *failed = &messages[sent].msg_hdr;
        if (n < 0 && failed->msg_controllen && gs_gso_refused(errno)) {
            gso_works = 0;
            send_singly(fd, failed);
        }
        sent += 1; /* refused or unreachable: skip it, its timer resends */
    }
    return sent;
}

/* Room for one batch of sends: up to MAX_BATCH messages of up to MAX_SEGMENTS packets. */
struct send_room {
    uint8_t headers[MAX_BATCH * MAX_SEGMENTS][HEADER_SIZE];
    struct iovec parts[MAX_BATCH * MAX_SEGMENTS * 2];
    struct sockaddr_in addresses[MAX_BATCH];
    union gs_segment_control controls[MAX_BATCH];
    struct mmsghdr messages[MAX_BATCH];
    size_t staged;                   /* bytes of stage in use */
    uint8_t stage[STAGE_BYTES];      /* coded packets' lanes, until the batch is sent */
    int coding;                      /* packets to encode before the batch goes (GIL released) */
    struct {
        const struct route *route;
        int64_t packet;
        uint8_t *lanes;
    } codes[MAX_BATCH * MAX_SEGMENTS];
};


/* Fill messages from `room->messages[*used]` on with chunk `index` of route `r`'s packets that
   have no result yet (a resent chunk repeats only those): GSO messages of as many packets as one
   send holds when GSO works, else one message per packet. Returns 0 when the batch has no room
   for them. */
static int add_chunk(struct send_room *room, int *used, int *packed, const struct route *r,
                     int64_t index) {
    const uint8_t *placed = (const uint8_t *)(uintptr_t)r->placed;
    int64_t from, to, missing[MAX_SEGMENTS];
    int count = 0;
    packets_of(r, index, &from, &to);
    for (int64_t packet = from; packet < to; packet++)
        if (!placed[packet]) missing[count++] = packet;
    if (count == 0) return 1;
    int64_t start, stop;
    byte_range(r, from, r->in_bits, &start, &stop);
    size_t full = HEADER_SIZE + (size_t)(stop - start); /* every packet but a stream's last */
    int per_send = gso_works ? (int)(GS_MAX_GSO_BYTES / full) : 1;
    per_send = per_send < 1 ? 1 : per_send;
    int needed = (count + per_send - 1) / per_send;
    if (*used + needed > MAX_BATCH || *packed + count > MAX_BATCH * MAX_SEGMENTS) return 0;
    /* a coded chunk's lanes go to the stage; one larger than it, to its upstream place */
    size_t lanes_bytes = (size_t)count * (full - HEADER_SIZE);
    int staging = r->codec != CODEC_NONE && lanes_bytes <= STAGE_BYTES;
    if (staging && room->staged + lanes_bytes > STAGE_BYTES) return 0;
    for (int i = 0; i < count; i++) {
        int64_t packet = missing[i];
        int at = *packed + i;
        byte_range(r, packet, r->in_bits, &start, &stop);
        pack(room->headers[at], r, r->base + packet, (uint32_t)lanes_of(r, packet));
        uint8_t *lanes = (uint8_t *)(uintptr_t)r->upstream + start;
        if (staging) {
            lanes = room->stage + room->staged;
            room->staged += (size_t)(stop - start);
        }
        if (r->codec != CODEC_NONE)
            room->codes[room->coding++] = (typeof(room->codes[0])){r, packet, lanes};
        room->parts[2 * at] = (struct iovec){room->headers[at], HEADER_SIZE};
        room->parts[2 * at + 1] = (struct iovec){lanes, (size_t)(stop - start)};
    }
    for (int m = 0; m < needed; m++) {
        int at = *used + m, first = *packed + m * per_send;
        int segments = count - m * per_send < per_send ? count - m * per_send : per_send;
        room->addresses[at] = (struct sockaddr_in){.sin_family = AF_INET, .sin_port = r->port,
                                                   .sin_addr.s_addr = r->ip};
        struct msghdr *h = &room->messages[at].msg_hdr;
        *h = (struct msghdr){.msg_name = room->addresses + at,
                             .msg_namelen = sizeof room->addresses[0],
                             .msg_iov = room->parts + 2 * first,
                             .msg_iovlen = 2 * (size_t)segments};
        if (segments > 1) /* full packets but the last, which only a stream's last can be */
            gs_set_segments(h, &room->controls[at],
                            (uint16_t)(HEADER_SIZE + room->parts[2 * first + 1].iov_len));
        room->messages[at].msg_len = 0;
    }
    *used += needed, *packed += count;
    return 1;
}

static PyObject *py_send(PyObject *self, PyObject *args) {
    int fd;
    Py_buffer view;
    PyObject *chunks;
    if (!PyArg_ParseTuple(args, "iy*O", &fd, &view, &chunks)) return NULL;
    const struct route *routes;
    Py_ssize_t nroutes;
    if (!routes_of(&view, &routes, &nroutes)) {
        PyBuffer_Release(&view);
        return NULL;
    }
    PyObject *fast = PySequence_Fast(chunks, "chunks must be a sequence of (route, chunk)");
    struct send_room *room = fast == NULL ? NULL : PyMem_RawMalloc(sizeof *room);
    if (room == NULL) {
        if (fast != NULL) PyErr_NoMemory();
        Py_XDECREF(fast);
        PyBuffer_Release(&view);
        return NULL;
    }
    Py_ssize_t total = PySequence_Fast_GET_SIZE(fast), done = 0;
    while (done < total) {
        int used = 0, packed = 0;
        room->staged = 0, room->coding = 0;
        Py_ssize_t taken = 0;
        for (; done + taken < total; taken++) {
            Py_ssize_t which;
            long long chunk;
            if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, done + taken), "nL", &which,
                                  &chunk))
                goto fail;
            if (which < 0 || which >= nroutes) {
                PyErr_Format(PyExc_IndexError, "route %zd of %zd", which, nroutes);
                goto fail;
            }
            const struct route *r = routes + which;
            if (chunk < r->first || chunk >= r->first + r->count) {
                PyErr_Format(PyExc_ValueError, "chunk %lld is not route %zd's", chunk, which);
                goto fail;
            }
            if (r->segments < 1 || r->segments > MAX_SEGMENTS) {
                PyErr_Format(PyExc_ValueError, "%lld segments per chunk (1 to %d)",
                             (long long)r->segments, MAX_SEGMENTS);
                goto fail;
            }
            if (!add_chunk(room, &used, &packed, r, chunk - r->first)) break;
        }
        Py_BEGIN_ALLOW_THREADS
        for (int i = 0; i < room->coding; i++)
            encode_packet(room->codes[i].route, room->codes[i].packet, room->codes[i].lanes);
        send_batch(fd, room->messages, used);
        Py_END_ALLOW_THREADS
        done += taken;
    }
    Py_DECREF(fast);
    PyMem_RawFree(room);
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(total);
fail:
    Py_DECREF(fast);
    PyMem_RawFree(room);
    PyBuffer_Release(&view);
    return NULL;
}

static PyObject *py_route_size(PyObject *self, PyObject *unused) {
    return PyLong_FromSize_t(sizeof(struct route));
}

static PyMethodDef methods[] = {
    {"receive", py_receive, METH_VARARGS,
     "receive(fds, routes, wait_ms, limit) -> [(route, chunk, contributors, flags, event)]"},
    {"send", py_send, METH_VARARGS, "send(fd, routes, [(route, chunk), ...]) -> chunks sent"},
    {"route_size", py_route_size, METH_NOARGS, "sizeof(struct route), checked against ROUTE"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pump",
                                    "The worker's datagram pump (see net/pump.py).", -1, methods};

PyMODINIT_FUNC PyInit__pump(void) {
    return PyModule_Create(&module);
}
