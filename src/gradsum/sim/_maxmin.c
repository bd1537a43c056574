/* Max-min fair rates by progressive filling: fluid.py's _progressive_filling in C.
 *
 * The simulator re-solves the rates whenever a flow starts or ends (tens of thousands of times
 * in a 32-worker run). In numpy each filling round is a dozen array calls over the live flows,
 * so the per-call overhead of ~13 rounds, not the flow count, cost most of a simulation
 * (py-spy: ~63 % of a VGG16 priority run). Here each resource lists the flows crossing it, and
 * a round touches only the flows of the resources it saturates. A long run keeps every path
 * class it ever used, and at any moment about a quarter of them carry flows (2,000 classes, 520
 * live, in a 32-worker priority run): the setup walks the live ones only, and a round divides
 * once per resource still crossed and updates only the resources it freed capacity on.
 *
 *   fill(paths, width, stride, count, flows, capacity, rates) -> rounds
 *     paths:    int64, ``width`` rows of ``stride`` entries (row k = path slot k of every path
 *               class); class i crosses resources paths[k * stride + i] for k < width, an
 *               unused slot holding len(capacity) (the spare resource, which never saturates).
 *     flows:    float64, flows in flight per class (classes with none are skipped, rate 0;
 *               only the paths of classes with flows are read, and checked).
 *     capacity: float64, one per resource.
 *     rates:    float64 output, ``count`` entries: the rate of each flow of the class.
 *   drain(classes, count, remaining, rates, dt, slack, done, flows) -> finished
 *     Drains every flow for ``dt`` seconds (remaining -= rates * dt); a flow whose rest would
 *     take at most ``slack`` seconds is finished: its index goes to ``done`` (int64, ascending),
 *     its class loses a flow in ``flows``, and it is removed, the others moving down in order in
 *     ``classes`` (int64, each flow's path class) and ``remaining``.
 *   next_completion(remaining, rates, count) -> seconds until the first flow would finish.
 *
 * The arithmetic is the numpy version's, operation for operation (absolute levels, the same
 * relative tie, remaining -= level * freed per resource), and drain's and next_completion's are
 * fluid.py's expressions, so both paths give the same results bit for bit;
 * tests/sim/test_fluid.py compares them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define RELATIVE_TIE 1e-9

static int get_buffer(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t itemsize,
                      const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) return -1;
    if (view->itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "%s: expected items of %zd bytes", what, itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *fill(PyObject *self, PyObject *args) {
    PyObject *slots_obj, *flows_obj, *capacity_obj, *rates_obj;
    Py_ssize_t width, stride, count;
    if (!PyArg_ParseTuple(args, "OnnnOOO", &slots_obj, &width, &stride, &count, &flows_obj,
                          &capacity_obj, &rates_obj))
        return NULL;
    Py_buffer slots_view, flows_view, capacity_view, rates_view;
    if (get_buffer(slots_obj, &slots_view, 0, 8, "paths") < 0) return NULL;
    if (get_buffer(flows_obj, &flows_view, 0, 8, "flows") < 0) {
        PyBuffer_Release(&slots_view);
        return NULL;
    }
    if (get_buffer(capacity_obj, &capacity_view, 0, 8, "capacity") < 0) {
        PyBuffer_Release(&slots_view);
        PyBuffer_Release(&flows_view);
        return NULL;
    }
    if (get_buffer(rates_obj, &rates_view, 1, 8, "rates") < 0) {
        PyBuffer_Release(&slots_view);
        PyBuffer_Release(&flows_view);
        PyBuffer_Release(&capacity_view);
        return NULL;
    }
    const Py_ssize_t resources = capacity_view.len / 8;
    PyObject *result = NULL;
    if (width < 1 || count < 0 || stride < count || slots_view.len / 8 < width * stride ||
        rates_view.len / 8 < count || flows_view.len / 8 < count) {
        PyErr_SetString(PyExc_ValueError, "fill: paths, count, flows and rates do not agree");
        goto done;
    }
    const int64_t *slots = (const int64_t *)slots_view.buf;
    const double *capacity = (const double *)capacity_view.buf;
    const double *flows = (const double *)flows_view.buf;
    double *rates = (double *)rates_view.buf;
    const Py_ssize_t spare = resources;
    double *remaining = malloc(sizeof(double) * (resources + 1));
    double *counts = malloc(sizeof(double) * (resources + 1));
    double *freed = malloc(sizeof(double) * (resources + 1));
    Py_ssize_t *first = malloc(sizeof(Py_ssize_t) * (resources + 2));
    Py_ssize_t *live = malloc(sizeof(Py_ssize_t) * (count + 1));
    Py_ssize_t *active = malloc(sizeof(Py_ssize_t) * (resources + 1));
    Py_ssize_t *list = malloc(sizeof(Py_ssize_t) * (resources + 1));
    double *share = malloc(sizeof(double) * (resources + 1));
    Py_ssize_t *members = malloc(sizeof(Py_ssize_t) * (width * count + 1));
    unsigned char *frozen = calloc(count + 1, 1);
    if (!remaining || !counts || !freed || !first || !live || !active || !list || !share ||
        !members || !frozen) {
        PyErr_NoMemory();
        goto release;
    }
    /* Only the classes with flows in flight take part (a long run keeps every path it ever
       used, most of them idle at any moment): every pass below walks them, not all classes. */
    Py_ssize_t alive = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        rates[i] = 0.0;
        if (flows[i] > 0)
            live[alive++] = i;
        else
            frozen[i] = 1;
    }
    /* Which classes cross each resource (compressed rows), so a round touches only the
       classes of the resources it saturates instead of scanning every live one. */
    for (Py_ssize_t r = 0; r <= spare + 1; r++) first[r] = 0;
    for (Py_ssize_t r = 0; r <= spare; r++) counts[r] = 0.0;
    for (Py_ssize_t j = 0; j < alive; j++)
        for (Py_ssize_t k = 0; k < width; k++) {
            int64_t r = slots[k * stride + live[j]];
            if (r < 0 || r > resources) {
                PyErr_Format(PyExc_ValueError, "fill: class %zd crosses resource %lld of %zd",
                             live[j], (long long)r, resources);
                goto release;
            }
            if (r == spare) continue; /* an unused slot: the spare never saturates */
            first[r + 1]++;
            counts[r] += flows[live[j]];
        }
    for (Py_ssize_t r = 0; r <= spare; r++) first[r + 1] += first[r];
    for (Py_ssize_t r = 0; r < resources; r++) remaining[r] = capacity[r];
    remaining[spare] = INFINITY;
    counts[spare] = 0.0;
    {
        Py_ssize_t *fill_at = malloc(sizeof(Py_ssize_t) * (resources + 1));
        if (!fill_at) {
            PyErr_NoMemory();
            goto release;
        }
        memcpy(fill_at, first, sizeof(Py_ssize_t) * (resources + 1));
        for (Py_ssize_t j = 0; j < alive; j++)
            for (Py_ssize_t k = 0; k < width; k++) {
                int64_t r = slots[k * stride + live[j]];
                if (r != spare) members[fill_at[r]++] = live[j];
            }
        free(fill_at);
    }
    /* The resources some live class crosses, and each one's fair share this round: a round
       divides once per such resource, and only the resources it freed capacity on change. */
    Py_ssize_t used = 0;
    for (Py_ssize_t r = 0; r < spare; r++) {
        freed[r] = 0;
        if (counts[r] > 0) {
            active[used] = r;
            share[used++] = remaining[r] / counts[r];
        }
    }
    long rounds = 0;
    while (alive > 0) {
        rounds++;
        double level = INFINITY;
        for (Py_ssize_t a = 0; a < used; a++)
            if (share[a] < level) level = share[a];
        const double bound = level * (1 + RELATIVE_TIE);
        Py_ssize_t before = alive, touched = 0;
        for (Py_ssize_t a = 0; a < used; a++) {
            if (!(share[a] <= bound)) continue;
            Py_ssize_t r = active[a];
            for (Py_ssize_t m = first[r]; m < first[r + 1]; m++) {
                Py_ssize_t i = members[m];
                if (frozen[i]) continue;
                frozen[i] = 1;
                alive--;
                rates[i] = level;
                for (Py_ssize_t k = 0; k < width; k++) {
                    int64_t q = slots[k * stride + i];
                    if (q == spare) continue;
                    if (freed[q] == 0) list[touched++] = q; /* a live class's flows are > 0 */
                    freed[q] += flows[i];
                }
            }
        }
        if (alive == before) { /* cannot happen with finite capacities; never loop forever */
            PyErr_SetString(PyExc_RuntimeError, "fill: progressive filling made no progress");
            goto release;
        }
        /* remaining -= level * freed and counts -= freed, as numpy does for every resource:
           on the others freed is 0 and they stay as they are */
        for (Py_ssize_t t = 0; t < touched; t++) {
            Py_ssize_t r = list[t];
            remaining[r] -= level * freed[r];
            counts[r] -= freed[r];
            freed[r] = 0;
        }
        Py_ssize_t kept = 0;
        for (Py_ssize_t a = 0; a < used; a++) {
            Py_ssize_t r = active[a];
            if (!(counts[r] > 0)) continue; /* no live class crosses it any more */
            active[kept] = r;
            share[kept++] = remaining[r] / counts[r];
        }
        used = kept;
    }
    result = PyLong_FromLong(rounds);
release:
    free(remaining);
    free(counts);
    free(freed);
    free(first);
    free(live);
    free(active);
    free(list);
    free(share);
    free(members);
    free(frozen);
done:
    PyBuffer_Release(&slots_view);
    PyBuffer_Release(&flows_view);
    PyBuffer_Release(&capacity_view);
    PyBuffer_Release(&rates_view);
    return result;
}

static PyObject *drain(PyObject *self, PyObject *args) {
    PyObject *classes_obj, *remaining_obj, *rates_obj, *done_obj, *flows_obj;
    Py_ssize_t count;
    double dt, slack;
    if (!PyArg_ParseTuple(args, "OnOOddOO", &classes_obj, &count, &remaining_obj, &rates_obj,
                          &dt, &slack, &done_obj, &flows_obj))
        return NULL;
    Py_buffer views[5];
    PyObject *objects[5] = {classes_obj, remaining_obj, rates_obj, done_obj, flows_obj};
    const int writable[5] = {1, 1, 0, 1, 1};
    const char *names[5] = {"classes", "remaining", "rates", "done", "flows"};
    int got = 0;
    PyObject *result = NULL;
    for (; got < 5; got++)
        if (get_buffer(objects[got], &views[got], writable[got], 8, names[got]) < 0) goto done;
    if (count < 0 || views[0].len / 8 < count || views[1].len / 8 < count ||
        views[2].len / 8 < count || views[3].len / 8 < count) {
        PyErr_SetString(PyExc_ValueError, "drain: count exceeds the arrays");
        goto done;
    }
    int64_t *classes = (int64_t *)views[0].buf;
    double *remaining = (double *)views[1].buf;
    const double *rates = (const double *)views[2].buf;
    int64_t *finished = (int64_t *)views[3].buf;
    double *flows = (double *)views[4].buf;
    const Py_ssize_t num_classes = views[4].len / 8;
    for (Py_ssize_t i = 0; i < count; i++)
        if (classes[i] < 0 || classes[i] >= num_classes) {
            PyErr_Format(PyExc_ValueError, "drain: flow %zd has no class", i);
            goto done;
        }
    Py_ssize_t ended = 0, kept = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        double left = remaining[i] - rates[i] * dt;
        if (left <= rates[i] * slack + 1e-6) {
            finished[ended++] = i;
            flows[classes[i]] -= 1.0;
            continue;
        }
        classes[kept] = classes[i];
        remaining[kept++] = left;
    }
    result = PyLong_FromSsize_t(ended);
done:
    for (int k = 0; k < got; k++) PyBuffer_Release(&views[k]);
    return result;
}

static PyObject *next_completion(PyObject *self, PyObject *args) {
    PyObject *remaining_obj, *rates_obj;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "OOn", &remaining_obj, &rates_obj, &count)) return NULL;
    Py_buffer remaining_view, rates_view;
    if (get_buffer(remaining_obj, &remaining_view, 0, 8, "remaining") < 0) return NULL;
    if (get_buffer(rates_obj, &rates_view, 0, 8, "rates") < 0) {
        PyBuffer_Release(&remaining_view);
        return NULL;
    }
    PyObject *result = NULL;
    if (count < 0 || remaining_view.len / 8 < count || rates_view.len / 8 < count) {
        PyErr_SetString(PyExc_ValueError, "next_completion: count exceeds the arrays");
    } else {
        const double *remaining = remaining_view.buf, *rates = rates_view.buf;
        double first = INFINITY;
        for (Py_ssize_t i = 0; i < count; i++) {
            double t = remaining[i] / rates[i];
            if (t < first || isnan(t)) first = t;
            if (isnan(first)) break; /* numpy's min propagates NaN */
        }
        result = PyFloat_FromDouble(first);
    }
    PyBuffer_Release(&remaining_view);
    PyBuffer_Release(&rates_view);
    return result;
}

static PyMethodDef methods[] = {
    {"fill", fill, METH_VARARGS, "Max-min fair rates by progressive filling (see fluid.py)."},
    {"drain", drain, METH_VARARGS, "Drain flows for dt seconds, removing the finished ones."},
    {"next_completion", next_completion, METH_VARARGS, "Seconds until the first flow ends."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_maxmin", NULL, -1, methods};

PyMODINIT_FUNC PyInit__maxmin(void) { return PyModule_Create(&module); }
