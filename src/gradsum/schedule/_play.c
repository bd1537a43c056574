/* A PS plan played out on its resources: costs.py's ps_group_ends loop in C.
 *
 * The merge planners' searches price every candidate plan with a play (thousands per model:
 * most of the simulator's seed tables' time, tests/sim/conftest.py). costs.py computes what a
 * play needs from the plan and the cluster and passes it here flat; this loop is the Python
 * loop's, event for event and operation for operation (the same expressions in the same order,
 * ``b if b > a else a`` as ``b > a ? b : a``, integer products of bytes converted to double where
 * Python converts them), compiled without fused multiply-adds, so both give the same ends bit for
 * bit; tests/schedule/test_play.py compares them. The send window is schedule/dispatch.py's
 * SendWindow as the representative worker (worker 0, whose rotation starts at part 0) drives it.
 *
 *   play(scalars, ints, senders, local, home, release, group_start, part_bytes, part_shard,
 *        group_bytes, rotated) -> list of each group's end
 *     scalars: (alpha_shard, worker_bw, nic_bw, shard_bw, cores or None, worker_wait,
 *               worker_cpu)
 *     ints:    (workers, shards, one_core, credit_bytes or None)
 *     senders: flat (machine, workers there) pairs of the machines with workers, in order
 *     local:   workers per machine;  home: each shard's machine
 *     release: each group's release time;  group_start: its first part's index (G + 1 entries)
 *     part_bytes, part_shard: per part (int);  group_bytes: per group (int)
 *     rotated: per group, 1 where its parts are gated by the rotated send order
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>

enum { RELEASE, START, PUSHED, PULLED, BACK };

typedef struct {
    double time;
    int64_t seq;
    int kind;
    Py_ssize_t g, j;
} Event;

static inline int earlier(const Event *a, const Event *b) {
    return a->time < b->time || (a->time == b->time && a->seq < b->seq);
}

typedef struct {
    Event *items;
    Py_ssize_t size;
} Heap;

static void heap_push(Heap *h, Event e) {
    Py_ssize_t i = h->size++;
    while (i > 0) {
        Py_ssize_t parent = (i - 1) / 2;
        if (!earlier(&e, &h->items[parent])) break;
        h->items[i] = h->items[parent];
        i = parent;
    }
    h->items[i] = e;
}

static Event heap_pop(Heap *h) {
    Event top = h->items[0];
    Event last = h->items[--h->size];
    Py_ssize_t i = 0, n = h->size;
    for (;;) {
        Py_ssize_t child = 2 * i + 1;
        if (child >= n) break;
        if (child + 1 < n && earlier(&h->items[child + 1], &h->items[child])) child++;
        if (!earlier(&h->items[child], &last)) break;
        h->items[i] = h->items[child];
        i = child;
    }
    if (n > 0) h->items[i] = last;
    return top;
}

typedef struct {
    /* the cluster */
    Py_ssize_t n, m, machines, nsenders;
    double ash, rate, nic_bw, shard_rate, cores, wait, cpu, worker_work;
    int has_cores, one_core;
    const int64_t *senders, *local, *home;
    /* state */
    double pool, thread, egress, ingress;
    double *nic_in, *nic_out, *shard_in, *shard_core, *shard_out;
} Play;

static double cross(Play *p, double start, int64_t shard, int64_t nbytes, int inward) {
    double *into = inward ? p->nic_in : p->nic_out;
    double *out_of = inward ? p->nic_out : p->nic_in;
    int64_t there = p->home[shard];
    double done = start;
    for (Py_ssize_t k = 0; k < p->nsenders; k++) {
        int64_t machine = p->senders[2 * k], count = p->senders[2 * k + 1];
        if (machine != there) {
            double free = out_of[machine];
            out_of[machine] = (free > start ? free : start) + (double)(count * nbytes) / p->nic_bw;
            if (out_of[machine] > done) done = out_of[machine];
        }
    }
    int64_t remote = p->n - p->local[there];
    if (remote) {
        double free = into[there];
        into[there] = (free > start ? free : start) + (double)(remote * nbytes) / p->nic_bw;
        if (into[there] > done) done = into[there];
    }
    return done;
}

static double on_cores(Play *p, double start, double serial, double work) {
    if (!p->has_cores) return start + serial;
    double begin = p->pool > start ? p->pool : start;
    p->pool = begin + work / p->cores;
    double end = begin + serial;
    return p->pool > end ? p->pool : end;
}

static double worker_message(Play *p, double start) {
    return on_cores(p, start + p->wait, p->cpu, p->worker_work);
}

/* One item as a C value at `out`: 0 with an exception set where it is not one. */
typedef int (*store_item)(PyObject *item, void *out);

static int store_int64(PyObject *item, void *out) {
    int64_t value = PyLong_AsLongLong(item);
    *(int64_t *)out = value;
    return !(value == -1 && PyErr_Occurred());
}

static int store_double(PyObject *item, void *out) {
    double value = PyFloat_AsDouble(item);
    *(double *)out = value;
    return !(value == -1.0 && PyErr_Occurred());
}

/* A sequence of Python numbers as a C array of `size`-byte items; NULL with an exception set. */
static void *c_array(PyObject *seq, Py_ssize_t *len, const char *what, size_t size,
                     store_item store) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (!fast) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    char *out = malloc(size * (n ? n : 1));
    if (!out) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!store(items[i], out + i * size)) {
            Py_DECREF(fast);
            free(out);
            return NULL;
        }
    }
    Py_DECREF(fast);
    *len = n;
    return out;
}

static int64_t *int_array(PyObject *seq, Py_ssize_t *len, const char *what) {
    return c_array(seq, len, what, sizeof(int64_t), store_int64);
}

static double *double_array(PyObject *seq, Py_ssize_t *len, const char *what) {
    return c_array(seq, len, what, sizeof(double), store_double);
}

static PyObject *play(PyObject *self, PyObject *args) {
    PyObject *scalars, *ints, *senders_o, *local_o, *home_o, *release_o, *start_o, *bytes_o,
        *shard_o, *gbytes_o, *rotated_o;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOO", &scalars, &ints, &senders_o, &local_o, &home_o,
                          &release_o, &start_o, &bytes_o, &shard_o, &gbytes_o, &rotated_o))
        return NULL;
    Play p = {0};
    PyObject *cores_o, *credit_o;
    long long n, m, one_core;
    if (!PyArg_ParseTuple(scalars, "ddddOdd", &p.ash, &p.rate, &p.nic_bw, &p.shard_rate,
                          &cores_o, &p.wait, &p.cpu))
        return NULL;
    if (!PyArg_ParseTuple(ints, "LLLO", &n, &m, &one_core, &credit_o)) return NULL;
    p.n = (Py_ssize_t)n;
    p.m = (Py_ssize_t)m;
    p.one_core = one_core != 0;
    p.has_cores = cores_o != Py_None;
    if (p.has_cores) {
        p.cores = PyFloat_AsDouble(cores_o);
        if (p.cores == -1.0 && PyErr_Occurred()) return NULL;
    }
    int has_credit = credit_o != Py_None;
    int64_t credit = 0;
    if (has_credit) {
        credit = PyLong_AsLongLong(credit_o);
        if (credit == -1 && PyErr_Occurred()) return NULL;
    }
    p.worker_work = (double)p.n * p.cpu;
    double answer_spread = (double)(p.n - 1) * p.ash;

    PyObject *result = NULL;
    int64_t *senders = NULL, *local = NULL, *home = NULL, *group_start = NULL, *part_bytes = NULL,
            *part_shard = NULL, *group_bytes = NULL, *rotated = NULL;
    double *release = NULL, *arena = NULL;
    Py_ssize_t nsend2 = 0, machines = 0, nhome = 0, groups = 0, nstart = 0, parts = 0, nshard = 0,
               ngbytes = 0, nrot = 0;
    Event *events = NULL;
    int64_t *stream_next = NULL, *stream_head = NULL, *stream_tail = NULL, *waiting = NULL,
            *parts_left = NULL, *busy = NULL, *starts = NULL, *gate = NULL, *part_group = NULL;
    char *sent_set = NULL, *arrived_set = NULL;

    if (!(senders = int_array(senders_o, &nsend2, "senders"))) goto done;
    if (!(local = int_array(local_o, &machines, "local"))) goto done;
    if (!(home = int_array(home_o, &nhome, "home"))) goto done;
    if (!(release = double_array(release_o, &groups, "release"))) goto done;
    if (!(group_start = int_array(start_o, &nstart, "group_start"))) goto done;
    if (!(part_bytes = int_array(bytes_o, &parts, "part_bytes"))) goto done;
    if (!(part_shard = int_array(shard_o, &nshard, "part_shard"))) goto done;
    if (!(group_bytes = int_array(gbytes_o, &ngbytes, "group_bytes"))) goto done;
    if (!(rotated = int_array(rotated_o, &nrot, "rotated"))) goto done;
    if (nhome != p.m || nstart != groups + 1 || nshard != parts || ngbytes != groups ||
        nrot != groups || nsend2 % 2 || group_start[0] != 0 || group_start[groups] != parts) {
        PyErr_SetString(PyExc_ValueError, "play: inconsistent plan arrays");
        goto done;
    }
    for (Py_ssize_t g = 0; g < groups; g++) {
        if (group_start[g] < 0 || group_start[g + 1] < group_start[g]) {
            PyErr_SetString(PyExc_ValueError, "play: group_start must not decrease");
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < parts; i++) {
        if (part_shard[i] < 0 || part_shard[i] >= p.m) {
            PyErr_SetString(PyExc_ValueError, "play: a part's shard is out of range");
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < p.m; i++) {
        if (home[i] < 0 || home[i] >= machines) {
            PyErr_SetString(PyExc_ValueError, "play: a shard's machine is out of range");
            goto done;
        }
    }
    for (Py_ssize_t k = 0; k < nsend2; k += 2) {
        if (senders[k] < 0 || senders[k] >= machines) {
            PyErr_SetString(PyExc_ValueError, "play: a sender's machine is out of range");
            goto done;
        }
    }
    p.machines = machines;
    p.nsenders = nsend2 / 2;
    p.senders = senders;
    p.local = local;
    p.home = home;

    /* doubles: nic_in, nic_out (machines); shard_in, shard_core, shard_out (m); ends (G);
     * sent, arrived, leads, spread (P) */
    Py_ssize_t ndoubles = 2 * machines + 3 * p.m + groups + 4 * parts + 1;
    arena = calloc(ndoubles, sizeof(double));
    Py_ssize_t capacity = groups + 4 * parts + 1;
    events = malloc(sizeof(Event) * capacity);
    stream_next = malloc(sizeof(int64_t) * (parts + 1));
    stream_head = malloc(sizeof(int64_t) * (p.m + 1));
    stream_tail = malloc(sizeof(int64_t) * (p.m + 1));
    waiting = malloc(sizeof(int64_t) * (groups + 1));
    parts_left = calloc(groups + 1, sizeof(int64_t));
    busy = calloc(p.m + 1, sizeof(int64_t));
    starts = malloc(sizeof(int64_t) * (parts + 1));
    gate = malloc(sizeof(int64_t) * (parts + 1));
    part_group = malloc(sizeof(int64_t) * (parts + 1));
    sent_set = calloc(parts + 1, 1);
    arrived_set = calloc(parts + 1, 1);
    if (!arena || !events || !stream_next || !stream_head || !stream_tail || !waiting ||
        !parts_left || !busy || !starts || !gate || !part_group || !sent_set || !arrived_set) {
        PyErr_NoMemory();
        goto done;
    }
    p.nic_in = arena;
    p.nic_out = p.nic_in + machines;
    p.shard_in = p.nic_out + machines;
    p.shard_core = p.shard_in + p.m;
    p.shard_out = p.shard_core + p.m;
    double *ends = p.shard_out + p.m;
    double *sent = ends + groups, *arrived = sent + parts, *leads = arrived + parts,
           *spread = leads + parts;
    for (Py_ssize_t s = 0; s < p.m; s++) stream_head[s] = stream_tail[s] = -1;
    /* the rotated gate of each part: the position whose send completes it at its shard */
    for (Py_ssize_t g = 0; g < groups; g++) {
        Py_ssize_t a = group_start[g], k = group_start[g + 1] - a;
        Py_ssize_t first = (p.n < k ? p.n : k) - 1;
        for (Py_ssize_t j = 0; j < k; j++) {
            gate[a + j] = j >= first ? j : k - 1;
            part_group[a + j] = g;
        }
    }

    Heap heap = {events, 0};
    for (Py_ssize_t g = 0; g < groups; g++) heap_push(&heap, (Event){release[g], g, RELEASE, g, 0});
    int64_t seq = groups;
    Py_ssize_t wait_head = 0, wait_tail = 0;
    int64_t in_flight_bytes = 0, groups_in_flight = 0;

    while (heap.size) {
        Event e = heap_pop(&heap);
        double now = e.time;
        Py_ssize_t g = e.g, j = e.j, a = group_start[g], part = a + j;
        if (e.kind == START) {
            int64_t nbytes = part_bytes[part], s = part_shard[part];
            double busy_s = p.thread - now;
            double lead = spread[part] - (busy_s > 0.0 ? busy_s : 0.0);
            spread[part] = 0.0;
            if (!(lead > 0.0)) lead = 0.0;
            p.thread = worker_message(&p, p.thread > now ? p.thread : now);
            p.egress = (p.egress > p.thread ? p.egress : p.thread) + (double)nbytes / p.rate;
            if (!p.one_core) {
                double free = p.shard_in[s], begin = p.thread - lead;
                p.shard_in[s] =
                    (free > begin ? free : begin) + (double)(p.n * nbytes) / p.shard_rate;
            }
            double crossed = cross(&p, p.thread, s, nbytes, 1);
            sent[part] = p.egress;
            sent_set[part] = 1;
            double done_at = crossed > p.egress ? crossed : p.egress;
            arrived[part] = p.shard_in[s] > done_at ? p.shard_in[s] : done_at;
            arrived_set[part] = 1;
            leads[part] = lead;
            if (!rotated[g]) {
                double x = arrived[part], y = sent[part];
                heap_push(&heap, (Event){y > x ? y : x, seq++, PUSHED, g, j});
            } else {
                Py_ssize_t k = group_start[g + 1] - a;
                for (Py_ssize_t i = 0; i < k; i++) {
                    int64_t position = gate[a + i];
                    if (!(i == j || position == j)) continue;
                    if (arrived_set[a + i] && sent_set[a + position]) {
                        double x = arrived[a + i], y = sent[a + position];
                        heap_push(&heap, (Event){y > x ? y : x, seq++, PUSHED, g, i});
                    }
                }
            }
        } else if (e.kind == PUSHED) {
            int64_t nbytes = part_bytes[part], s = part_shard[part];
            double lead = leads[part];
            leads[part] = 0.0;
            double per = p.ash + (p.one_core ? (double)nbytes / p.shard_rate : 0.0);
            double begin = now - lead, core = p.shard_core[s];
            double work = (double)p.n * per;
            double queued = on_cores(&p, core > begin ? core : begin, work, work);
            double summed = now + per;
            if (queued > summed) summed = queued;
            p.shard_core[s] = on_cores(&p, summed, work, work);
            if (!p.one_core) {
                double answer = summed + p.ash, free = p.shard_out[s];
                p.shard_out[s] =
                    (free > answer ? free : answer) + (double)(p.n * nbytes) / p.shard_rate;
            }
            core = p.shard_core[s];
            p.ingress = (p.ingress > core ? p.ingress : core) + (double)nbytes / p.rate;
            double crossed = cross(&p, summed + per, s, nbytes, 0);
            double back = p.shard_out[s];
            if (p.ingress > back) back = p.ingress;
            if (crossed > back) back = crossed;
            heap_push(&heap, (Event){back, seq++, PULLED, g, j});
        } else if (e.kind == PULLED) {
            p.thread = worker_message(&p, p.thread > now ? p.thread : now);
            if (p.thread > ends[g]) ends[g] = p.thread;
            heap_push(&heap, (Event){p.thread, seq++, BACK, g, j});
        } else {
            /* the send window (dispatch.SendWindow): release, or a part back */
            Py_ssize_t nstarts = 0;
            double staggered = 0.0;
            int64_t freed = -1;
            if (e.kind == RELEASE) {
                if (parts_left[g]) {
                    PyErr_Format(PyExc_ValueError, "group %zd released again while in flight", g);
                    goto done;
                }
                waiting[wait_tail++] = g;
            } else {
                freed = part_shard[part];
                busy[freed] = 0;
                parts_left[g] -= 1;
                Py_ssize_t head = stream_head[freed];
                if (head >= 0) { /* _next_on(freed) */
                    busy[freed] = 1;
                    stream_head[freed] = stream_next[head];
                    if (stream_head[freed] < 0) stream_tail[freed] = -1;
                    starts[nstarts++] = head;
                }
                if (parts_left[g] == 0) {
                    in_flight_bytes -= group_bytes[g];
                    groups_in_flight -= 1;
                }
                staggered = answer_spread;
            }
            if (e.kind == RELEASE || parts_left[g] == 0) { /* _admit() */
                while (wait_head < wait_tail) {
                    Py_ssize_t w = waiting[wait_head];
                    int fits = !groups_in_flight ||
                               (has_credit && in_flight_bytes + group_bytes[w] <= credit);
                    if (!fits) break;
                    wait_head++;
                    in_flight_bytes += group_bytes[w];
                    groups_in_flight += 1;
                    parts_left[w] = group_start[w + 1] - group_start[w];
                    for (Py_ssize_t q = group_start[w]; q < group_start[w + 1]; q++) {
                        int64_t s = part_shard[q];
                        stream_next[q] = -1;
                        if (stream_tail[s] >= 0)
                            stream_next[stream_tail[s]] = q;
                        else
                            stream_head[s] = q;
                        stream_tail[s] = q;
                        if (!busy[s]) { /* _next_on(s) */
                            Py_ssize_t head = stream_head[s];
                            busy[s] = 1;
                            stream_head[s] = stream_next[head];
                            if (stream_head[s] < 0) stream_tail[s] = -1;
                            starts[nstarts++] = head;
                        }
                    }
                }
            }
            /* the admitted parts take the thread before the freed stream's next part */
            for (int pass = 0; pass < 2; pass++) {
                for (Py_ssize_t i = 0; i < nstarts; i++) {
                    int64_t q = starts[i];
                    int on_freed = e.kind != RELEASE && part_shard[q] == freed;
                    if (on_freed != pass) continue;
                    Py_ssize_t h = part_group[q];
                    spread[q] = staggered;
                    heap_push(&heap, (Event){now, seq++, START, h, q - group_start[h]});
                }
            }
        }
    }
    result = PyList_New(groups);
    if (!result) goto done;
    for (Py_ssize_t g = 0; g < groups; g++) {
        PyObject *value = PyFloat_FromDouble(ends[g]);
        if (!value) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, g, value);
    }

done:
    free(senders);
    free(local);
    free(home);
    free(release);
    free(group_start);
    free(part_bytes);
    free(part_shard);
    free(group_bytes);
    free(rotated);
    free(arena);
    free(events);
    free(stream_next);
    free(stream_head);
    free(stream_tail);
    free(waiting);
    free(parts_left);
    free(busy);
    free(starts);
    free(gate);
    free(part_group);
    free(sent_set);
    free(arrived_set);
    return result;
}

static PyMethodDef methods[] = {
    {"play", play, METH_VARARGS, "A PS plan's group ends (costs.ps_group_ends)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_play", NULL, -1, methods};

PyMODINIT_FUNC PyInit__play(void) { return PyModule_Create(&module); }
