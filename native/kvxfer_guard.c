/*
 * The write guard's per-frame rules in C (part of kvxfer._native): the receiver's check of a write of
 * whole pages against the page ledger, its record of what landed, the completion's coverage and landed
 * checksum, and the ledger's ownership check of a state change. Each function is the twin of a Python rule in kvxfer/core/writeguard.py, which
 * stays the reference (tests/test_guard_native.py holds them equal on random and hostile run tables)
 * and decides everything these do not accept.
 *
 * guard_accept(runs, item_lens, num_pages, state, stamps, owner_gen, writable_mask) -> bytes | None
 *     The per-run page counts (int64) of a write every run of which is whole pages of a buffer of the
 *     layout, inside the pool, over pages whose state is in writable_mask (bit per PageState value) and
 *     whose stamp is owner_gen; None for anything else (the Python check then names the reason). It
 *     only ever accepts what WriteGuard._check_runs accepts.
 * guard_record(runs, item_lens, num_pages, covered, summed, item_sum, sums, state, stamps, gen,
 *              reserved, written) -> (duplicate_items, bytes)
 *     Record an accepted write: each (buffer, page) item covered, its landed checksum kept where `sums`
 *     (uint32, one per item in run order) is given else marked unsummed; then every touched page covered
 *     in every buffer whose state is `reserved` and stamp `gen` becomes `written`.
 * guard_landed(pages, item_lens, num_pages, covered, summed, item_sum, algo, initial) -> (uncovered, sum)
 *     How many of `pages` (int64) are not covered in every buffer, and the request checksum combined
 *     from the landed item checksums (buffer-major, as WriteGuard.landed_checksum), or None when an item
 *     has none or algo is -1 (coverage only).
 * random_take(items, n, out, seed)
 *     The random free list's pop: len(out) distinct entries of items[0:n] (int64) drawn uniformly at
 *     random into out, in random order (a partial Fisher-Yates shuffle, splitmix64 from seed); each
 *     pick's place is filled with the last entry still in the list, so items[0:n-len(out)] holds the
 *     rest. O(len(out)), where closing the holes with numpy masks cost O(n) several times over.
 * ledger_move(pages, state, stamps, gen, allowed_mask, new_state) -> bool
 *     PageLedger.move's rule: True, and every page (int64) moved to new_state (-1: none, a check only),
 *     when each is inside the pool, in a state of allowed_mask and stamped gen; False, changing nothing,
 *     when one is not (the Python ledger then names the pages).
 *
 * Arrays are the guard's and the ledger's own numpy buffers: runs as RUN_DTYPE records (u32 buffer,
 * u32 flags, u64 offset, u64 length), item_lens int64 per buffer, state uint8 and stamps uint64 per
 * page, covered / summed bool and item_sum uint32 per (buffer, page), flattened buffer-major. The caller
 * holds the engine's lock (the GIL stays held: these are short loops over small tables). Every index is
 * bounds-checked here whatever the caller checked: a bad one raises ValueError and writes nothing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "kvxfer_guard.h"

typedef struct {
    uint32_t buffer;
    uint32_t flags;
    uint64_t offset;
    uint64_t length;
} run_record;

/* A run's first page and page count when it is whole pages of a buffer inside the pool, else -1.
 * Offsets and lengths past 2^62 are left to Python (its int64 arithmetic decides them). */
static int whole_pages(const run_record *r, const int64_t *items, size_t num_buffers, uint64_t num_pages,
                       uint64_t *first, uint64_t *count) {
    if (r->buffer >= num_buffers || r->length == 0) return -1;
    if (r->offset >= (1ull << 62) || r->length >= (1ull << 62)) return -1;
    int64_t item = items[r->buffer];
    if (item <= 0) return -1;
    uint64_t it = (uint64_t)item;
    if (r->offset % it || r->length % it) return -1;
    *first = r->offset / it;
    *count = r->length / it;
    if (*first + *count > num_pages) return -1;
    return 0;
}

static int check_tables(Py_buffer *runs, Py_buffer *items, Py_buffer *state, Py_buffer *stamps,
                        uint64_t num_pages) {
    if (runs->len == 0 || runs->len % (Py_ssize_t)sizeof(run_record) != 0) {
        PyErr_SetString(PyExc_ValueError, "runs must be one or more 24-byte run records");
        return -1;
    }
    if (items->len == 0 || items->len % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "item_lens must be int64, one per buffer");
        return -1;
    }
    if ((uint64_t)state->len != num_pages || (uint64_t)stamps->len != num_pages * 8) {
        PyErr_SetString(PyExc_ValueError, "state (uint8) and stamps (uint64) must have one entry per page");
        return -1;
    }
    return 0;
}

PyObject *guard_accept(PyObject *self, PyObject *args) {
    Py_buffer runs, items, state, stamps;
    unsigned long long num_pages, owner_gen;
    unsigned int writable;
    if (!PyArg_ParseTuple(args, "y*y*Ky*y*KI", &runs, &items, &num_pages, &state, &stamps, &owner_gen, &writable))
        return NULL;
    PyObject *out = NULL;
    if (check_tables(&runs, &items, &state, &stamps, num_pages) < 0) goto done;
    size_t n = (size_t)runs.len / sizeof(run_record);
    size_t num_buffers = (size_t)items.len / 8;
    const run_record *r = (const run_record *)runs.buf;
    const int64_t *it = (const int64_t *)items.buf;
    const uint8_t *st = (const uint8_t *)state.buf;
    const uint64_t *gen = (const uint64_t *)stamps.buf;
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n * 8));
    if (out == NULL) goto done;
    int64_t *counts = (int64_t *)PyBytes_AS_STRING(out);
    for (size_t i = 0; i < n; i++) {
        uint64_t first, count;
        if (whole_pages(&r[i], it, num_buffers, num_pages, &first, &count) < 0) goto refuse;
        for (uint64_t p = first; p < first + count; p++) {
            if (st[p] >= 32 || !((writable >> st[p]) & 1u) || gen[p] != owner_gen) goto refuse;
        }
        counts[i] = (int64_t)count;
    }
    goto done;
refuse:
    Py_DECREF(out);
    out = Py_None;
    Py_INCREF(out);
done:
    PyBuffer_Release(&runs);
    PyBuffer_Release(&items);
    PyBuffer_Release(&state);
    PyBuffer_Release(&stamps);
    return out;
}

PyObject *guard_record(PyObject *self, PyObject *args) {
    Py_buffer runs, items, covered, summed, item_sum, state, stamps;
    Py_buffer sums = {0};
    PyObject *sums_obj;
    unsigned long long num_pages, gen;
    unsigned int reserved, written;
    if (!PyArg_ParseTuple(args, "y*y*Kw*w*w*Ow*y*KII", &runs, &items, &num_pages, &covered, &summed, &item_sum,
                          &sums_obj, &state, &stamps, &gen, &reserved, &written))
        return NULL;
    PyObject *out = NULL;
    int have_sums = 0;
    if (sums_obj != Py_None) {
        if (PyObject_GetBuffer(sums_obj, &sums, PyBUF_SIMPLE) < 0) goto done;
        have_sums = 1;
    }
    if (check_tables(&runs, &items, &state, &stamps, num_pages) < 0) goto done;
    size_t n = (size_t)runs.len / sizeof(run_record);
    size_t num_buffers = (size_t)items.len / 8;
    uint64_t cells = (uint64_t)num_buffers * num_pages;
    if ((uint64_t)covered.len != cells || (uint64_t)summed.len != cells || (uint64_t)item_sum.len != cells * 4) {
        PyErr_SetString(PyExc_ValueError, "covered, summed (bool) and item_sum (uint32) must be (buffers, pages)");
        goto done;
    }
    const run_record *r = (const run_record *)runs.buf;
    const int64_t *it = (const int64_t *)items.buf;
    uint64_t total_items = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t first, count;
        if (whole_pages(&r[i], it, num_buffers, num_pages, &first, &count) < 0) {
            PyErr_Format(PyExc_ValueError, "run %zu is not whole pages of a buffer inside the pool", i);
            goto done;
        }
        total_items += count;
    }
    /* the item checksums count only when there is one per recorded item, as the Python twin takes them */
    const uint32_t *s = NULL;
    if (have_sums && (uint64_t)sums.len == total_items * 4) s = (const uint32_t *)sums.buf;
    uint8_t *cov = (uint8_t *)covered.buf, *sm = (uint8_t *)summed.buf;
    uint32_t *isum = (uint32_t *)item_sum.buf;
    uint8_t *st = (uint8_t *)state.buf;
    const uint64_t *stamp = (const uint64_t *)stamps.buf;
    uint64_t duplicates = 0, nbytes = 0, k = 0;
    for (size_t i = 0; i < n; i++) {  /* items covered before this write (a repeat within it is not one) */
        uint64_t first = r[i].offset / (uint64_t)it[r[i].buffer], count = r[i].length / (uint64_t)it[r[i].buffer];
        uint64_t base = (uint64_t)r[i].buffer * num_pages;
        for (uint64_t p = first; p < first + count; p++) duplicates += cov[base + p] != 0;
    }
    for (size_t i = 0; i < n; i++) {
        uint64_t first = r[i].offset / (uint64_t)it[r[i].buffer], count = r[i].length / (uint64_t)it[r[i].buffer];
        uint64_t base = (uint64_t)r[i].buffer * num_pages;
        for (uint64_t p = first; p < first + count; p++, k++) {
            cov[base + p] = 1;
            if (s != NULL) {
                isum[base + p] = s[k];
                sm[base + p] = 1;
            } else {
                sm[base + p] = 0;
            }
        }
        nbytes += r[i].length;
    }
    for (size_t i = 0; i < n; i++) {  /* WRITTEN once covered in every buffer */
        uint64_t first = r[i].offset / (uint64_t)it[r[i].buffer], count = r[i].length / (uint64_t)it[r[i].buffer];
        for (uint64_t p = first; p < first + count; p++) {
            if (st[p] != reserved || stamp[p] != gen) continue;
            size_t b = 0;
            while (b < num_buffers && cov[(uint64_t)b * num_pages + p]) b++;
            if (b == num_buffers) st[p] = (uint8_t)written;
        }
    }
    out = Py_BuildValue("(KK)", (unsigned long long)duplicates, (unsigned long long)nbytes);
done:
    if (have_sums) PyBuffer_Release(&sums);
    PyBuffer_Release(&runs);
    PyBuffer_Release(&items);
    PyBuffer_Release(&covered);
    PyBuffer_Release(&summed);
    PyBuffer_Release(&item_sum);
    PyBuffer_Release(&state);
    PyBuffer_Release(&stamps);
    return out;
}

PyObject *guard_landed(PyObject *self, PyObject *args) {
    Py_buffer pages, items, covered, summed, item_sum;
    unsigned long long num_pages, initial;
    int algo;
    if (!PyArg_ParseTuple(args, "y*y*Ky*y*y*iK", &pages, &items, &num_pages, &covered, &summed, &item_sum, &algo,
                          &initial))
        return NULL;
    PyObject *out = NULL;
    if (pages.len % 8 != 0 || items.len == 0 || items.len % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "pages and item_lens must be int64 arrays");
        goto done;
    }
    size_t n = (size_t)pages.len / 8, num_buffers = (size_t)items.len / 8;
    uint64_t cells = (uint64_t)num_buffers * num_pages;
    if ((uint64_t)covered.len != cells || (uint64_t)summed.len != cells || (uint64_t)item_sum.len != cells * 4) {
        PyErr_SetString(PyExc_ValueError, "covered, summed (bool) and item_sum (uint32) must be (buffers, pages)");
        goto done;
    }
    const int64_t *pg = (const int64_t *)pages.buf;
    const int64_t *it = (const int64_t *)items.buf;
    const uint8_t *cov = (const uint8_t *)covered.buf, *sm = (const uint8_t *)summed.buf;
    const uint32_t *isum = (const uint32_t *)item_sum.buf;
    for (size_t i = 0; i < n; i++) {
        if (pg[i] < 0 || (uint64_t)pg[i] >= num_pages) {
            PyErr_Format(PyExc_ValueError, "page %lld is outside the pool's %llu pages", (long long)pg[i],
                         num_pages);
            goto done;
        }
    }
    uint64_t uncovered = 0;
    int all_summed = algo >= 0;
    for (size_t i = 0; i < n; i++) {
        size_t b = 0;
        while (b < num_buffers && cov[(uint64_t)b * num_pages + (uint64_t)pg[i]]) b++;
        uncovered += b != num_buffers;
        for (size_t c = 0; all_summed && c < num_buffers; c++) all_summed = sm[(uint64_t)c * num_pages + (uint64_t)pg[i]];
    }
    if (!all_summed) {
        out = Py_BuildValue("(KO)", (unsigned long long)uncovered, Py_None);
        goto done;
    }
    uint32_t acc;
    if (n == 0) {
        acc = (uint32_t)initial;  /* nothing to combine */
    } else if (n * num_buffers == 1) {
        acc = isum[(uint64_t)pg[0]];  /* one piece is its own checksum (combine's rule) */
    } else {
        acc = (uint32_t)initial;
        for (size_t b = 0; b < num_buffers; b++) {
            uint32_t op;
            if (native_combine_prepare(algo, (uint64_t)it[b], &op) < 0) goto done;
            for (size_t i = 0; i < n; i++)
                acc = native_combine_step(algo, acc, isum[(uint64_t)b * num_pages + (uint64_t)pg[i]], (uint64_t)it[b], op);
        }
    }
    out = Py_BuildValue("(KI)", (unsigned long long)uncovered, (unsigned int)acc);
done:
    PyBuffer_Release(&pages);
    PyBuffer_Release(&items);
    PyBuffer_Release(&covered);
    PyBuffer_Release(&summed);
    PyBuffer_Release(&item_sum);
    return out;
}

PyObject *ledger_move(PyObject *self, PyObject *args) {
    Py_buffer pages, state, stamps;
    unsigned long long gen;
    unsigned int allowed;
    int new_state;
    if (!PyArg_ParseTuple(args, "y*w*y*KIi", &pages, &state, &stamps, &gen, &allowed, &new_state)) return NULL;
    PyObject *out = NULL;
    size_t num_pages = (size_t)state.len;
    if (pages.len % 8 != 0 || (size_t)stamps.len != num_pages * 8 || new_state > 255) {
        PyErr_SetString(PyExc_ValueError, "pages (int64), state (uint8) and stamps (uint64) of the ledger");
        goto done;
    }
    size_t n = (size_t)pages.len / 8;
    const int64_t *pg = (const int64_t *)pages.buf;
    uint8_t *st = (uint8_t *)state.buf;
    const uint64_t *stamp = (const uint64_t *)stamps.buf;
    for (size_t i = 0; i < n; i++) {
        if (pg[i] < 0 || (uint64_t)pg[i] >= num_pages) goto refuse;
        uint8_t s = st[pg[i]];
        if (s >= 32 || !((allowed >> s) & 1u) || stamp[pg[i]] != gen) goto refuse;
    }
    if (new_state >= 0)
        for (size_t i = 0; i < n; i++) st[pg[i]] = (uint8_t)new_state;
    out = Py_True;
    Py_INCREF(out);
    goto done;
refuse:
    out = Py_False;
    Py_INCREF(out);
done:
    PyBuffer_Release(&pages);
    PyBuffer_Release(&state);
    PyBuffer_Release(&stamps);
    return out;
}

static inline uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

PyObject *random_take(PyObject *self, PyObject *args) {
    Py_buffer items, out;
    Py_ssize_t n;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "w*nw*K", &items, &n, &out, &seed)) return NULL;
    PyObject *result = NULL;
    size_t count = (size_t)out.len / 8;
    if (items.len % 8 != 0 || out.len % 8 != 0 || n < 0 || (size_t)n > (size_t)items.len / 8 || count > (size_t)n) {
        PyErr_SetString(PyExc_ValueError, "items and out must be int64 arrays, out no longer than the n <= len(items) live entries");
        goto done;
    }
    int64_t *it = (int64_t *)items.buf, *o = (int64_t *)out.buf;
    uint64_t x = seed, live = (uint64_t)n;
    Py_BEGIN_ALLOW_THREADS  /* the caller holds the ledger's lock; the arrays are its own */
    for (size_t i = 0; i < count; i++, live--) {
        uint64_t j = (uint64_t)(((unsigned __int128)splitmix64(&x) * live) >> 64);
        o[i] = it[j];
        it[j] = it[live - 1];
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&items);
    PyBuffer_Release(&out);
    return result;
}
