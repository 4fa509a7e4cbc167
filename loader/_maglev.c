/* The Maglev table fill (loader/maglev.py says what the table is and why), in C because
 * it is the inner loop of a controller's full sync: a table of M entries takes about
 * M ln M probes, and in Python hashing the backends and filling their table cost 0.15 ms
 * per 10-backend service port, 1.5 s of a 10k-service sync; here a few microseconds.
 *
 *   fill(m, idents) -> bytes
 *     idents: a sequence of bytes, one backend identity per backend_map slot, in slot
 *     order. Returns M uint16 in host order, entry -> slot, as bpf/lb.h lb_slot() reads.
 *   fill_packed(m, records, stride, ident_len) -> bytes
 *     the same, the identities being the first ident_len bytes of each record of a
 *     buffer (backend_map values as a writer packs them).
 *   permutation(m, ident) -> (offset, skip)
 *     where a backend's permutation starts and how it steps (for the tests' reference
 *     fill and for docs/datapath.md's description).
 *
 * The paper's algorithm (Eisenbud et al., NSDI 2016, section 3.4): backend i walks its
 * permutation (offset_i + j * skip_i) mod M; in turn, each backend takes the next entry
 * of its permutation still free, until all M entries are taken. Turns go in the order of
 * the identities (bytewise), never the order a node received the endpoints in: every node
 * computes the same table for the same set. The caller checks that M is prime. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* A backend's offset and skip come from a 64-bit hash of its identity: FNV-1a over the
 * bytes, then MurmurHash3's fmix64 finaliser (every input bit reaches every output bit),
 * once per value with its own seed. Not cryptographic: the identities are the cluster's
 * own endpoint addresses, and all a table needs is spread. Fixed seeds: every node and
 * every release computing tables for the same set must agree while flows move between
 * nodes. */
#define SEED_OFFSET 0x6b786c622d6f6666ull   /* "kxlb-off" */
#define SEED_SKIP   0x6b786c622d736b70ull   /* "kxlb-skp" */

static uint64_t fmix64(uint64_t k)
{
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ull;
    k ^= k >> 33;
    return k;
}

static uint64_t ident_hash(const unsigned char *p, Py_ssize_t len, uint64_t seed)
{
    uint64_t h = 0xcbf29ce484222325ull ^ seed;
    for (Py_ssize_t i = 0; i < len; i++) {
        h ^= p[i];
        h *= 0x100000001b3ull;
    }
    return fmix64(h ^ (uint64_t)len);
}

static void offset_skip(const unsigned char *p, Py_ssize_t len, uint32_t m, uint32_t *offset, uint32_t *skip)
{
    *offset = (uint32_t)(ident_hash(p, len, SEED_OFFSET) % m);
    *skip = (uint32_t)(ident_hash(p, len, SEED_SKIP) % (m - 1)) + 1;
}

struct turn {
    const unsigned char *ident;
    Py_ssize_t len;
    uint32_t pos, skip;   /* next entry of the permutation to try; its step */
    uint16_t slot;
};

static int turn_cmp(const void *a, const void *b)
{
    const struct turn *x = a, *y = b;
    Py_ssize_t n = x->len < y->len ? x->len : y->len;
    int c = memcmp(x->ident, y->ident, n);
    if (c)
        return c;
    if (x->len != y->len)
        return x->len < y->len ? -1 : 1;
    return (int)x->slot - (int)y->slot;   /* the same backend twice: still one order */
}

static int check_m(Py_ssize_t m, Py_ssize_t n)
{
    if (m < 2 || m > 65535 || m <= n) {
        PyErr_Format(PyExc_ValueError, "maglev: table size %zd for %zd backends (needs a prime above the "
                     "backend count, at most 65535)", m, n);
        return -1;
    }
    return 0;
}

/* The fill itself, over turns whose ident/len/slot are set: hashes, orders, fills.
 * Takes ownership of nothing; returns the table (M uint16) or NULL with an error set. */
static PyObject *fill_turns(Py_ssize_t m, struct turn *turns, Py_ssize_t n)
{
    if (n < 1) {
        PyErr_SetString(PyExc_ValueError, "maglev fill: no backends");
        return NULL;
    }
    if (check_m(m, n) < 0)
        return NULL;
    uint8_t *taken = calloc(m, 1);
    PyObject *out = PyBytes_FromStringAndSize(NULL, m * 2);
    if (!taken || !out) {
        free(taken);
        Py_XDECREF(out);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++)
        offset_skip(turns[i].ident, turns[i].len, (uint32_t)m, &turns[i].pos, &turns[i].skip);
    qsort(turns, n, sizeof(*turns), turn_cmp);

    uint16_t *table = (uint16_t *)PyBytes_AS_STRING(out);
    const uint32_t um = (uint32_t)m;
    Py_ssize_t left = m;
    while (left) {
        for (Py_ssize_t i = 0; i < n && left; i++) {
            struct turn *t = &turns[i];
            uint32_t c = t->pos;
            while (taken[c])
                c = c + t->skip >= um ? c + t->skip - um : c + t->skip;
            taken[c] = 1;
            table[c] = t->slot;
            t->pos = c + t->skip >= um ? c + t->skip - um : c + t->skip;
            left--;
        }
    }
    free(taken);
    return out;
}

static PyObject *fill(PyObject *self, PyObject *args)
{
    Py_ssize_t m;
    PyObject *seq, *fast, *out = NULL;
    struct turn *turns = NULL;

    if (!PyArg_ParseTuple(args, "nO", &m, &seq))
        return NULL;
    fast = PySequence_Fast(seq, "maglev fill: idents must be a sequence of bytes");
    if (!fast)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    turns = malloc((n ? n : 1) * sizeof(*turns));
    if (!turns) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PySequence_Fast_GET_ITEM(fast, i);
        if (!PyBytes_Check(b)) {
            PyErr_Format(PyExc_TypeError, "maglev fill: identity %zd is %.50s, not bytes", i, Py_TYPE(b)->tp_name);
            goto out;
        }
        turns[i].ident = (const unsigned char *)PyBytes_AS_STRING(b);
        turns[i].len = PyBytes_GET_SIZE(b);
        turns[i].slot = (uint16_t)i;
    }
    out = fill_turns(m, turns, n);
out:
    free(turns);
    Py_DECREF(fast);
    return out;
}

/* The same table from backend_map values packed back to back (what a writer has in hand
 * anyway): record i, ``stride`` bytes, is slot i, and its first ``ident_len`` bytes are
 * the backend's identity. Saves a full sync a bytes object per backend. */
static PyObject *fill_packed(PyObject *self, PyObject *args)
{
    Py_ssize_t m, stride, ident_len;
    Py_buffer buf;
    PyObject *out = NULL;

    if (!PyArg_ParseTuple(args, "ny*nn", &m, &buf, &stride, &ident_len))
        return NULL;
    if (stride < 1 || ident_len < 1 || ident_len > stride || buf.len % stride) {
        PyErr_Format(PyExc_ValueError, "maglev fill_packed: %zd bytes are not records of %zd bytes with a "
                     "%zd-byte identity", buf.len, stride, ident_len);
        goto out;
    }
    Py_ssize_t n = buf.len / stride;
    struct turn *turns = malloc((n ? n : 1) * sizeof(*turns));
    if (!turns) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        turns[i].ident = (const unsigned char *)buf.buf + i * stride;
        turns[i].len = ident_len;
        turns[i].slot = (uint16_t)i;
    }
    out = fill_turns(m, turns, n);
    free(turns);
out:
    PyBuffer_Release(&buf);
    return out;
}

static PyObject *permutation(PyObject *self, PyObject *args)
{
    Py_ssize_t m;
    Py_buffer ident;
    uint32_t offset, skip;

    if (!PyArg_ParseTuple(args, "ny*", &m, &ident))
        return NULL;
    if (check_m(m, 1) < 0) {
        PyBuffer_Release(&ident);
        return NULL;
    }
    offset_skip(ident.buf, ident.len, (uint32_t)m, &offset, &skip);
    PyBuffer_Release(&ident);
    return Py_BuildValue("(II)", offset, skip);
}

static PyMethodDef methods[] = {
    {"fill", fill, METH_VARARGS,
     "fill(m, idents) -> bytes: the Maglev table of M entries for the backends whose identities "
     "(bytes) are given in slot order; M uint16 slot numbers in host order."},
    {"fill_packed", fill_packed, METH_VARARGS,
     "fill_packed(m, records, stride, ident_len) -> bytes: fill() for identities that are the first "
     "ident_len bytes of each stride-byte record of a buffer (slot i is record i)."},
    {"permutation", permutation, METH_VARARGS,
     "permutation(m, ident) -> (offset, skip): where the backend's permutation of a table of M starts, "
     "and its step."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_maglev", "The Maglev table fill (see loader/maglev.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__maglev(void)
{
    return PyModule_Create(&module);
}
