/*
 * kvxfer._native: the tcp and shm transports' byte-moving loops, in C, with the GIL released.
 *
 * recv_runs(fd, addresses, lengths): fill every (address, length) run from a blocking socket with
 *     readv(2), in order, until all bytes arrived. Raises ConnectionError on EOF, OSError on error.
 * send_runs(fd, prefix, addresses, lengths): send `prefix` then every run with sendmsg(2)
 *     (MSG_NOSIGNAL), handling partial sends.
 * copy_runs(dst_addresses, src_addresses, lengths): memcpy every run (the shm transport's gather
 *     into its ring and scatter out of it, and the bench's scattered-memcpy baseline).
 * copy_runs_summed(dst_addresses, src_addresses, lengths, item_lens, algo, initial, chunk): the same,
 *     checksumming every item of the destination right after it was copied (still in cache).
 * ring_load(address) / ring_store(address, value): load-acquire / store-release of a 64-bit word
 *     (the shm ring's producer and consumer positions and state words, shared between processes).
 * ring_copy(...): pages <-> an shm byte ring, streamed: waits for the other side's position before
 *     each piece and publishes its own after each chunk, item checksums as above (see the function).
 *
 * `addresses` and `lengths` are native-endian uint64 arrays (numpy .tobytes() of uint64). The
 * caller guarantees every run lies inside memory it registered: the write guard has checked the
 * destination runs against the page ledger before recv_runs is called, and the source runs come
 * from the sender's own layout. Nothing here allocates or copies payload bytes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>

#define IOV_BATCH 512

/* zlib-ng's checksums, looked up in the zlib_ng Python extension that is already loaded (it exports
 * zng_adler32 / zng_crc32), so items are checksummed in C with the GIL released. algo 0 = Adler-32,
 * 1 = CRC32. */
typedef uint32_t (*checksum_fn)(uint32_t, const uint8_t *, uint32_t);
static checksum_fn checksums[2] = {NULL, NULL};

static PyObject *load_zlib_ng(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    void *handle = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (handle == NULL) Py_RETURN_FALSE;
    checksums[0] = (checksum_fn)dlsym(handle, "zng_adler32");
    checksums[1] = (checksum_fn)dlsym(handle, "zng_crc32");
    if (checksums[0] == NULL || checksums[1] == NULL) {
        checksums[0] = checksums[1] = NULL;
        Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

static checksum_fn pick_checksum(int algo) {
    if (algo < 0 || algo > 1 || checksums[algo] == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "zlib-ng checksums not loaded (call load_zlib_ng first)");
        return NULL;
    }
    return checksums[algo];
}

/* Checksum one run as whole items (or as one piece when item == 0). Lengths are split at 1 GiB to
 * fit zlib-ng's 32-bit length. GIL not needed. */
static uint32_t checksum_span(checksum_fn fn, uint32_t value, const uint8_t *p, uint64_t len) {
    while (len > 0) {
        uint32_t piece = len > (1u << 30) ? (1u << 30) : (uint32_t)len;
        value = fn(value, p, piece);
        p += piece;
        len -= piece;
    }
    return value;
}

static int parse_runs(Py_buffer *addrs, Py_buffer *lens, size_t *count) {
    if (addrs->len != lens->len || addrs->len % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "addresses and lengths must be uint64 arrays of equal size");
        return -1;
    }
    *count = (size_t)addrs->len / 8;
    return 0;
}

/* Fill runs [first, end) from fd with readv; returns 0, an errno, or -1 for EOF. GIL not held. */
static int recv_range(int fd, const uint64_t *a, const uint64_t *l, size_t first, size_t end) {
    struct iovec iov[IOV_BATCH];
    size_t i = first, off = 0;
    while (i < end) {
        if (l[i] == off) { i++; off = 0; continue; }
        int k = 0;
        size_t j = i, o = off;
        while (j < end && k < IOV_BATCH) {
            iov[k].iov_base = (char *)(uintptr_t)a[j] + o;
            iov[k].iov_len = (size_t)(l[j] - o);
            o = 0;
            k++;
            j++;
        }
        ssize_t r = readv(fd, iov, k);
        if (r < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (r == 0) return -1;
        size_t got = (size_t)r;
        while (got > 0) {
            size_t left = (size_t)l[i] - off;
            if (got >= left) { got -= left; i++; off = 0; }
            else { off += got; got = 0; }
        }
    }
    return 0;
}

static PyObject *raise_recv(int rc) {
    if (rc < 0) {
        PyErr_SetString(PyExc_ConnectionError, "peer closed the connection");
        return NULL;
    }
    errno = rc;
    return PyErr_SetFromErrno(PyExc_OSError);
}

static PyObject *recv_runs(PyObject *self, PyObject *args) {
    int fd;
    Py_buffer addrs, lens;
    size_t n;
    if (!PyArg_ParseTuple(args, "iy*y*", &fd, &addrs, &lens)) return NULL;
    if (parse_runs(&addrs, &lens, &n) < 0) {
        PyBuffer_Release(&addrs);
        PyBuffer_Release(&lens);
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = recv_range(fd, (const uint64_t *)addrs.buf, (const uint64_t *)lens.buf, 0, n);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&addrs);
    PyBuffer_Release(&lens);
    if (rc) return raise_recv(rc);
    Py_RETURN_NONE;
}

/* Item checksums (each from `init`) of runs [first, end) into sums[*slot...]. GIL not needed. */
static void sum_items(checksum_fn fn, uint32_t init, const uint64_t *a, const uint64_t *l, const uint64_t *it,
                      size_t first, size_t end, uint32_t *sums, size_t *slot) {
    for (size_t i = first; i < end; i++)
        for (uint64_t off = 0; off < l[i]; off += it[i])
            sums[(*slot)++] = checksum_span(fn, init, (const uint8_t *)(uintptr_t)(a[i] + off), it[i]);
}

/* Shared argument checks of the *_summed functions; returns the item count or -1. */
static Py_ssize_t summed_items(Py_buffer *addrs, Py_buffer *lens, Py_buffer *items, size_t *n) {
    if (parse_runs(addrs, lens, n) < 0) return -1;
    if (items->len != addrs->len) {
        PyErr_SetString(PyExc_ValueError, "item_lens must have one uint64 per run");
        return -1;
    }
    const uint64_t *l = (const uint64_t *)lens->buf, *it = (const uint64_t *)items->buf;
    size_t total = 0;
    for (size_t i = 0; i < *n; i++) {
        if (it[i] == 0 || l[i] % it[i]) {
            PyErr_SetString(PyExc_ValueError, "a run is not a whole number of items");
            return -1;
        }
        total += (size_t)(l[i] / it[i]);
    }
    return (Py_ssize_t)total;
}

/* recv_runs_summed(fd, addresses, lengths, item_lens, algo, initial, chunk) -> bytes
 * Like recv_runs, but lands the runs in groups of about `chunk` bytes and, right after each group
 * lands (while it is still in cache), checksums every item of every run of the group (runs are whole
 * items of item_lens[i] bytes), each from `initial`. Returns the item checksums as uint32, in order. */
static PyObject *recv_runs_summed(PyObject *self, PyObject *args) {
    int fd, algo;
    Py_buffer addrs, lens, items;
    unsigned long long initial, chunk;
    size_t n;
    if (!PyArg_ParseTuple(args, "iy*y*y*iKK", &fd, &addrs, &lens, &items, &algo, &initial, &chunk)) return NULL;
    PyObject *out = NULL;
    checksum_fn fn = pick_checksum(algo);
    Py_ssize_t count = fn == NULL ? -1 : summed_items(&addrs, &lens, &items, &n);
    if (count < 0) goto done;
    out = PyBytes_FromStringAndSize(NULL, count * 4);
    if (out == NULL) goto done;
    const uint64_t *a = (const uint64_t *)addrs.buf, *l = (const uint64_t *)lens.buf, *it = (const uint64_t *)items.buf;
    uint32_t *sums = (uint32_t *)PyBytes_AS_STRING(out);
    int rc = 0;
    Py_BEGIN_ALLOW_THREADS
    size_t first = 0, slot = 0;
    while (first < n && rc == 0) {
        size_t end = first, bytes = 0;
        while (end < n && (end == first || bytes + l[end] <= chunk)) bytes += l[end++];
        rc = recv_range(fd, a, l, first, end);
        if (rc == 0) sum_items(fn, (uint32_t)initial, a, l, it, first, end, sums, &slot);
        first = end;
    }
    Py_END_ALLOW_THREADS
    if (rc) { raise_recv(rc); Py_CLEAR(out); }
done:
    PyBuffer_Release(&addrs);
    PyBuffer_Release(&lens);
    PyBuffer_Release(&items);
    return out;
}

/* Send `prefix` (may be empty) then runs [first, end) with sendmsg; 0 or an errno. GIL not held. */
static int send_range(int fd, const char *prefix, size_t prefix_len, const uint64_t *a, const uint64_t *l,
                      size_t first, size_t end) {
    struct iovec iov[IOV_BATCH];
    /* run index first-1 is the prefix */
    long i = (long)first - 1;
    size_t off = 0;
    while (i < (long)end) {
        int k = 0;
        long j = i;
        size_t o = off;
        while (j < (long)end && k < IOV_BATCH) {
            const char *base = j < (long)first ? prefix : (const char *)(uintptr_t)a[j];
            size_t len = j < (long)first ? prefix_len : (size_t)l[j];
            if (len > o) {
                iov[k].iov_base = (void *)(base + o);
                iov[k].iov_len = len - o;
                k++;
            }
            o = 0;
            j++;
        }
        if (k == 0) break;
        struct msghdr msg;
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = iov;
        msg.msg_iovlen = (size_t)k;
        ssize_t r = sendmsg(fd, &msg, MSG_NOSIGNAL);
        if (r < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        size_t sent = (size_t)r;
        while (sent > 0 && i < (long)end) {
            size_t len = i < (long)first ? prefix_len : (size_t)l[i];
            size_t left = len - off;
            if (sent >= left) { sent -= left; i++; off = 0; }
            else { off += sent; sent = 0; }
        }
        while (i < (long)end && (i < (long)first ? prefix_len : (size_t)l[i]) == off) { i++; off = 0; }
    }
    return 0;
}

static PyObject *send_runs(PyObject *self, PyObject *args) {
    int fd;
    Py_buffer prefix, addrs, lens;
    size_t n;
    if (!PyArg_ParseTuple(args, "iy*y*y*", &fd, &prefix, &addrs, &lens)) return NULL;
    if (parse_runs(&addrs, &lens, &n) < 0) {
        PyBuffer_Release(&prefix);
        PyBuffer_Release(&addrs);
        PyBuffer_Release(&lens);
        return NULL;
    }
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = send_range(fd, (const char *)prefix.buf, (size_t)prefix.len, (const uint64_t *)addrs.buf,
                     (const uint64_t *)lens.buf, 0, n);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&prefix);
    PyBuffer_Release(&addrs);
    PyBuffer_Release(&lens);
    if (err) { errno = err; return PyErr_SetFromErrno(PyExc_OSError); }
    Py_RETURN_NONE;
}

/* send_runs_summed(fd, prefix, addresses, lengths, item_lens, algo, initial, chunk) -> bytes
 * Like send_runs, in groups of about `chunk` bytes: each group's item checksums are computed just
 * before the group is sent, so the copy into the socket then reads from cache. Returns uint32 sums. */
static PyObject *send_runs_summed(PyObject *self, PyObject *args) {
    int fd, algo;
    Py_buffer prefix, addrs, lens, items;
    unsigned long long initial, chunk;
    size_t n;
    if (!PyArg_ParseTuple(args, "iy*y*y*y*iKK", &fd, &prefix, &addrs, &lens, &items, &algo, &initial, &chunk))
        return NULL;
    PyObject *out = NULL;
    checksum_fn fn = pick_checksum(algo);
    Py_ssize_t count = fn == NULL ? -1 : summed_items(&addrs, &lens, &items, &n);
    if (count < 0) goto done;
    out = PyBytes_FromStringAndSize(NULL, count * 4);
    if (out == NULL) goto done;
    const uint64_t *a = (const uint64_t *)addrs.buf, *l = (const uint64_t *)lens.buf, *it = (const uint64_t *)items.buf;
    uint32_t *sums = (uint32_t *)PyBytes_AS_STRING(out);
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    size_t first = 0, slot = 0;
    int with_prefix = 1;
    while (first < n && err == 0) {
        size_t end = first, bytes = 0;
        while (end < n && (end == first || bytes + l[end] <= chunk)) bytes += l[end++];
        sum_items(fn, (uint32_t)initial, a, l, it, first, end, sums, &slot);
        err = send_range(fd, (const char *)prefix.buf, with_prefix ? (size_t)prefix.len : 0, a, l, first, end);
        with_prefix = 0;
        first = end;
    }
    Py_END_ALLOW_THREADS
    if (err) { errno = err; PyErr_SetFromErrno(PyExc_OSError); Py_CLEAR(out); }
done:
    PyBuffer_Release(&prefix);
    PyBuffer_Release(&addrs);
    PyBuffer_Release(&lens);
    PyBuffer_Release(&items);
    return out;
}

/* checksum_runs(algo, value, addresses, lengths) -> int: the checksum continued over every run in
 * order, in C with the GIL released. */
static PyObject *checksum_runs(PyObject *self, PyObject *args) {
    int algo;
    unsigned long long value;
    Py_buffer addrs, lens;
    size_t n;
    if (!PyArg_ParseTuple(args, "iKy*y*", &algo, &value, &addrs, &lens)) return NULL;
    checksum_fn fn = pick_checksum(algo);
    if (fn == NULL || parse_runs(&addrs, &lens, &n) < 0) {
        PyBuffer_Release(&addrs);
        PyBuffer_Release(&lens);
        return NULL;
    }
    const uint64_t *a = (const uint64_t *)addrs.buf, *l = (const uint64_t *)lens.buf;
    uint32_t v = (uint32_t)value;
    Py_BEGIN_ALLOW_THREADS
    for (size_t i = 0; i < n; i++) v = checksum_span(fn, v, (const uint8_t *)(uintptr_t)a[i], l[i]);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&addrs);
    PyBuffer_Release(&lens);
    return PyLong_FromUnsignedLong(v);
}

/* checksum_items(algo, initial, addresses, lengths, item_lens) -> bytes: every item's checksum (each
 * from `initial`) as uint32, runs in order, in C with the GIL released. */
static PyObject *checksum_items(PyObject *self, PyObject *args) {
    int algo;
    unsigned long long initial;
    Py_buffer addrs, lens, items;
    size_t n;
    if (!PyArg_ParseTuple(args, "iKy*y*y*", &algo, &initial, &addrs, &lens, &items)) return NULL;
    PyObject *out = NULL;
    checksum_fn fn = pick_checksum(algo);
    Py_ssize_t count = fn == NULL ? -1 : summed_items(&addrs, &lens, &items, &n);
    if (count >= 0) out = PyBytes_FromStringAndSize(NULL, count * 4);
    if (out != NULL) {
        uint32_t *sums = (uint32_t *)PyBytes_AS_STRING(out);
        size_t slot = 0;
        Py_BEGIN_ALLOW_THREADS
        sum_items(fn, (uint32_t)initial, (const uint64_t *)addrs.buf, (const uint64_t *)lens.buf,
                  (const uint64_t *)items.buf, 0, n, sums, &slot);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&addrs);
    PyBuffer_Release(&lens);
    PyBuffer_Release(&items);
    return out;
}

/* Three uint64 arrays of equal size: destinations, sources, lengths. */
static int parse_copy(Py_buffer *dsts, Py_buffer *srcs, Py_buffer *lens, size_t *count) {
    if (parse_runs(dsts, lens, count) < 0) return -1;
    if (srcs->len != dsts->len) {
        PyErr_SetString(PyExc_ValueError, "destinations, sources and lengths must be uint64 arrays of equal size");
        return -1;
    }
    return 0;
}

/* copy_runs(dst_addresses, src_addresses, lengths): memcpy every run, in order, GIL released. The
 * caller guarantees every run lies inside memory it owns or mapped (the write guard checked the
 * destination pages; the ring span was bounds-checked against the mapping). */
static PyObject *copy_runs(PyObject *self, PyObject *args) {
    Py_buffer dsts, srcs, lens;
    size_t n;
    if (!PyArg_ParseTuple(args, "y*y*y*", &dsts, &srcs, &lens)) return NULL;
    int ok = parse_copy(&dsts, &srcs, &lens, &n) == 0;
    if (ok) {
        const uint64_t *d = (const uint64_t *)dsts.buf, *s = (const uint64_t *)srcs.buf, *l = (const uint64_t *)lens.buf;
        Py_BEGIN_ALLOW_THREADS
        for (size_t i = 0; i < n; i++)
            memcpy((void *)(uintptr_t)d[i], (const void *)(uintptr_t)s[i], (size_t)l[i]);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&dsts);
    PyBuffer_Release(&srcs);
    PyBuffer_Release(&lens);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* copy_runs_summed(dst_addresses, src_addresses, lengths, item_lens, algo, initial, chunk) -> bytes
 * Like copy_runs, in pieces of about `chunk` bytes (whole items; a run longer than that is cut at
 * item boundaries, shorter runs are grouped): each piece is copied, then every item of it is
 * checksummed (each from `initial`) at the destination while it is still in cache. The item
 * checksums of what landed, as recv_runs_summed returns them: uint32, runs in order. */
static PyObject *copy_runs_summed(PyObject *self, PyObject *args) {
    int algo;
    Py_buffer dsts, srcs, lens, items;
    unsigned long long initial, chunk;
    size_t n;
    if (!PyArg_ParseTuple(args, "y*y*y*y*iKK", &dsts, &srcs, &lens, &items, &algo, &initial, &chunk)) return NULL;
    PyObject *out = NULL;
    checksum_fn fn = pick_checksum(algo);
    Py_ssize_t count = -1;
    if (fn != NULL) {
        if (srcs.len != dsts.len) PyErr_SetString(PyExc_ValueError, "destinations, sources and lengths must be uint64 arrays of equal size");
        else count = summed_items(&dsts, &lens, &items, &n);
    }
    if (count < 0) goto done;
    out = PyBytes_FromStringAndSize(NULL, count * 4);
    if (out == NULL) goto done;
    const uint64_t *d = (const uint64_t *)dsts.buf, *s = (const uint64_t *)srcs.buf, *l = (const uint64_t *)lens.buf,
                   *it = (const uint64_t *)items.buf;
    uint32_t *sums = (uint32_t *)PyBytes_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS
    size_t slot = 0, first = 0;
    while (first < n) {
        if (l[first] > chunk) {  /* a long run alone, piece by piece of whole items */
            uint64_t step = chunk / it[first] * it[first];
            if (step == 0) step = it[first];
            for (uint64_t off = 0; off < l[first]; off += step) {
                uint64_t len = l[first] - off < step ? l[first] - off : step;
                uint8_t *dst = (uint8_t *)(uintptr_t)(d[first] + off);
                memcpy(dst, (const void *)(uintptr_t)(s[first] + off), (size_t)len);
                for (uint64_t k = 0; k < len; k += it[first])
                    sums[slot++] = checksum_span(fn, (uint32_t)initial, dst + k, it[first]);
            }
            first++;
            continue;
        }
        size_t end = first, bytes = 0;
        while (end < n && l[end] <= chunk && (end == first || bytes + l[end] <= chunk)) bytes += l[end++];
        for (size_t i = first; i < end; i++)
            memcpy((void *)(uintptr_t)d[i], (const void *)(uintptr_t)s[i], (size_t)l[i]);
        sum_items(fn, (uint32_t)initial, d, l, it, first, end, sums, &slot);
        first = end;
    }
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&dsts);
    PyBuffer_Release(&srcs);
    PyBuffer_Release(&lens);
    PyBuffer_Release(&items);
    return out;
}

/* ring_load(address) -> int: load-acquire of the aligned 64-bit word at `address`; every write the
 * other side made before its matching ring_store is visible after this returns. */
static PyObject *ring_load(PyObject *self, PyObject *args) {
    unsigned long long address;
    if (!PyArg_ParseTuple(args, "K", &address)) return NULL;
    if (address % 8) {
        PyErr_SetString(PyExc_ValueError, "ring words are 8-byte aligned");
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(__atomic_load_n((const uint64_t *)(uintptr_t)address, __ATOMIC_ACQUIRE));
}

/* ring_store(address, value): store-release of a 64-bit word: every write before it (the frame's
 * bytes, the landed pages) is visible to whoever load-acquires the new value. */
static PyObject *ring_store(PyObject *self, PyObject *args) {
    unsigned long long address, value;
    if (!PyArg_ParseTuple(args, "KK", &address, &value)) return NULL;
    if (address % 8) {
        PyErr_SetString(PyExc_ValueError, "ring words are 8-byte aligned");
        return NULL;
    }
    __atomic_store_n((uint64_t *)(uintptr_t)address, (uint64_t)value, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* ring_copy(addresses, lengths, item_lens, algo, initial, chunk, ring_data, ring_size, position, ring_is_src,
 *           wait_address, publish_address, stop_address, stop_value, closed_address, closed_value, pid)
 *   -> (rc, sums or None)
 *
 * The shm transport's payload copy, streamed through a single-producer/single-consumer byte ring of
 * ring_size bytes at ring_data. The runs (addresses[i], lengths[i]) are the pages' side; the ring
 * side is one byte stream starting at stream position `position` (ring offset position % ring_size,
 * wrapping at the end). ring_is_src = 1: the reader, ring -> pages; 0: the writer, pages -> ring.
 *
 * Before the piece that ends at stream offset e it waits until the 64-bit word at wait_address
 * (load-acquire) reaches position + e (reader: the producer position) or position + e - ring_size
 * (writer: the consumer position, i.e. room); after every `chunk` bytes, before it waits and at
 * the end it store-releases position + e at publish_address (its own position). Pieces are at most `chunk`
 * bytes of whole items; with algo >= 0 every item of the pages' side is checksummed (each from
 * `initial`) right after its piece was copied (still in cache): for the reader that is what landed,
 * as recv_runs_summed returns it; for the writer what it sent, as send_runs_summed.
 *
 * While waiting (a few sched_yield()s, then sleeps doubling from 20 us to 1 ms) it returns early:
 * rc 1 when the word at stop_address equals stop_value (the ring was fenced), rc 2 when the word at
 * closed_address equals closed_value and the wait is still unmet (the writer closed, or the link was
 * aborted), rc 3 when pid > 0 and that process no longer exists (checked every 0.5 s). rc 0: every
 * byte was copied and published. The GIL is released throughout. The caller guarantees the pages'
 * runs lie in memory it owns (the write guard checked them) and the ring mapping outlives the call. */
static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

#ifndef RING_YIELDS
#define RING_YIELDS 32 /* sched_yield()s before a waiting side sleeps: polling on a busy core starves the other side */
#endif

static int ring_wait_(const uint64_t *word, int64_t target, const uint64_t *stop, uint64_t stop_value,
                     const uint64_t *closed, uint64_t closed_value, long pid, int *slept);
/* Wait until *word >= target; 1 when *stop == stop_value, 2 when *closed == closed_value, 3 when
 * process pid is gone. GIL not held. */
static int ring_wait(const uint64_t *word, int64_t target, const uint64_t *stop, uint64_t stop_value,
                     const uint64_t *closed, uint64_t closed_value, long pid) {
    if ((int64_t)__atomic_load_n(word, __ATOMIC_ACQUIRE) >= target) return 0;
    int slept = 0;
    return ring_wait_(word, target, stop, stop_value, closed, closed_value, pid, &slept);
}
static int ring_wait_(const uint64_t *word, int64_t target, const uint64_t *stop, uint64_t stop_value,
                     const uint64_t *closed, uint64_t closed_value, long pid, int *slept) {
    unsigned spins = 0;
    long delay_ns = 20000;
    uint64_t next_check = 0;
    for (;;) {
        if ((int64_t)__atomic_load_n(word, __ATOMIC_ACQUIRE) >= target) return 0;
        if (__atomic_load_n(stop, __ATOMIC_ACQUIRE) == stop_value) return 1;
        if (__atomic_load_n(closed, __ATOMIC_ACQUIRE) == closed_value) {
            if ((int64_t)__atomic_load_n(word, __ATOMIC_ACQUIRE) >= target) return 0;
            return 2;
        }
        if (spins < RING_YIELDS) {  /* the other side usually publishes within microseconds */
            spins++;
            sched_yield();
            continue;
        }
        struct timespec ts = {0, delay_ns};
        nanosleep(&ts, NULL); (*slept)++;
        if (delay_ns < 1000000) delay_ns = delay_ns * 2 > 1000000 ? 1000000 : delay_ns * 2;
        if (pid > 0) {
            uint64_t t = now_ns();
            if (next_check == 0) next_check = t + 500000000ull;
            else if (t >= next_check) {
                next_check = t + 500000000ull;
                if (kill((pid_t)pid, 0) != 0 && errno == ESRCH) return 3;
            }
        }
    }
}

/* Copy `len` bytes between `pages` and the ring at offset `roff`, splitting at the ring's end. */
static inline void ring_move(int ring_is_src, uint8_t *pages, uint8_t *ring, uint64_t size, uint64_t roff,
                             uint64_t len) {
    uint64_t first = size - roff < len ? size - roff : len;
    if (ring_is_src) {
        memcpy(pages, ring + roff, (size_t)first);
        if (len > first) memcpy(pages + first, ring, (size_t)(len - first));
    } else {
        memcpy(ring + roff, pages, (size_t)first);
        if (len > first) memcpy(ring, pages + first, (size_t)(len - first));
    }
}

static PyObject *ring_copy(PyObject *self, PyObject *args) {
    Py_buffer addrs, lens, items;
    int algo, ring_is_src;
    unsigned long long initial, chunk, ring_data, ring_size, position, wait_address, publish_address, stop_address,
        stop_value, closed_address, closed_value;
    long pid;
    if (!PyArg_ParseTuple(args, "y*y*y*iKKKKKiKKKKKKl", &addrs, &lens, &items, &algo, &initial, &chunk, &ring_data,
                          &ring_size, &position, &ring_is_src, &wait_address, &publish_address, &stop_address,
                          &stop_value, &closed_address, &closed_value, &pid))
        return NULL;
    PyObject *out = NULL, *result = NULL;
    size_t n = 0;
    checksum_fn fn = NULL;
    if (parse_runs(&addrs, &lens, &n) < 0) goto done;
    if (chunk == 0 || ring_size == 0 || ring_size > (1ull << 62) || position > (1ull << 62) ||
        (wait_address | publish_address | stop_address | closed_address) % 8) {
        PyErr_SetString(PyExc_ValueError, "ring_copy needs a positive chunk and ring size and aligned ring words");
        goto done;
    }
    if (algo >= 0) {
        fn = pick_checksum(algo);
        Py_ssize_t count = fn == NULL ? -1 : summed_items(&addrs, &lens, &items, &n);
        if (count < 0) goto done;
        out = PyBytes_FromStringAndSize(NULL, count * 4);
        if (out == NULL) goto done;
    }
    const uint64_t *a = (const uint64_t *)addrs.buf, *l = (const uint64_t *)lens.buf, *it = (const uint64_t *)items.buf;
    uint32_t *sums = out == NULL ? NULL : (uint32_t *)PyBytes_AS_STRING(out);
    const uint64_t *wait = (const uint64_t *)(uintptr_t)wait_address, *stop = (const uint64_t *)(uintptr_t)stop_address,
                   *closed = (const uint64_t *)(uintptr_t)closed_address;
    uint64_t *publish = (uint64_t *)(uintptr_t)publish_address;
    uint8_t *ring = (uint8_t *)(uintptr_t)ring_data;
    int64_t lag = ring_is_src ? 0 : (int64_t)ring_size;  /* the writer waits for room, the reader for data */
    int rc = 0;
    Py_BEGIN_ALLOW_THREADS
    uint64_t e = 0, unpublished = 0;
    size_t slot = 0;
    for (size_t i = 0; i < n && rc == 0; i++) {
        uint64_t piece = chunk;
        if (fn != NULL) piece = chunk < it[i] ? it[i] : chunk / it[i] * it[i];
        for (uint64_t off = 0; off < l[i]; off += piece) {
            uint64_t len = l[i] - off < piece ? l[i] - off : piece;
            int64_t target = (int64_t)(position + e + len) - lag;
            if (unpublished && (int64_t)__atomic_load_n(wait, __ATOMIC_ACQUIRE) < target) {
                /* about to wait for the other side: it may be waiting for what we have not published */
                __atomic_store_n(publish, position + e, __ATOMIC_RELEASE);
                unpublished = 0;
            }
            rc = ring_wait(wait, target, stop, stop_value, closed, closed_value, pid);
            if (rc) break;
            uint8_t *pages = (uint8_t *)(uintptr_t)(a[i] + off);
            ring_move(ring_is_src, pages, ring, ring_size, (position + e) % ring_size, len);
            if (fn != NULL)
                for (uint64_t k = 0; k < len; k += it[i]) sums[slot++] = checksum_span(fn, (uint32_t)initial, pages + k, it[i]);
            e += len;
            unpublished += len;
            if (unpublished >= chunk) {
                __atomic_store_n(publish, position + e, __ATOMIC_RELEASE);
                unpublished = 0;
            }
        }
    }
    if (rc == 0 && unpublished) __atomic_store_n(publish, position + e, __ATOMIC_RELEASE);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(iO)", rc, rc == 0 && out != NULL ? out : Py_None);
done:
    Py_XDECREF(out);
    PyBuffer_Release(&addrs);
    PyBuffer_Release(&lens);
    PyBuffer_Release(&items);
    return result;
}

static PyMethodDef methods[] = {
    {"checksum_items", checksum_items, METH_VARARGS,
     "checksum_items(algo, initial, addresses, lengths, item_lens) -> uint32 item checksums"},
    {"copy_runs", copy_runs, METH_VARARGS, "copy_runs(dst_addresses, src_addresses, lengths): memcpy every run"},
    {"copy_runs_summed", copy_runs_summed, METH_VARARGS,
     "copy_runs_summed(dst_addresses, src_addresses, lengths, item_lens, algo, initial, chunk) -> uint32 item checksums"},
    {"ring_copy", ring_copy, METH_VARARGS,
     "ring_copy(addresses, lengths, item_lens, algo, initial, chunk, ring_data, ring_size, position, ring_is_src, "
     "wait_address, publish_address, stop_address, stop_value, closed_address, closed_value, pid) -> (rc, sums or None)"},
    {"ring_load", ring_load, METH_VARARGS, "ring_load(address) -> int: load-acquire of a 64-bit word"},
    {"ring_store", ring_store, METH_VARARGS, "ring_store(address, value): store-release of a 64-bit word"},
    {"checksum_runs", checksum_runs, METH_VARARGS, "checksum_runs(algo, value, addresses, lengths) -> int"},
    {"load_zlib_ng", load_zlib_ng, METH_VARARGS, "load_zlib_ng(path) -> bool: use zlib-ng's C checksums"},
    {"recv_runs", recv_runs, METH_VARARGS, "recv_runs(fd, addresses, lengths): fill runs from a socket"},
    {"recv_runs_summed", recv_runs_summed, METH_VARARGS,
     "recv_runs_summed(fd, addresses, lengths, item_lens, algo, initial, chunk) -> uint32 item checksums"},
    {"send_runs", send_runs, METH_VARARGS, "send_runs(fd, prefix, addresses, lengths): gather-send runs"},
    {"send_runs_summed", send_runs_summed, METH_VARARGS,
     "send_runs_summed(fd, prefix, addresses, lengths, item_lens, algo, initial, chunk) -> uint32 item checksums"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "kvxfer._native",
    .m_doc = "kvxfer's native data path (see native/).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
