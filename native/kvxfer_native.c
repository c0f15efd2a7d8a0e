/*
 * kvxfer._native: the tcp and shm transports' byte-moving loops, in C, with the GIL released.
 *
 * recv_runs(fd, addresses, lengths): fill every (address, length) run from a blocking socket with
 *     readv(2), in order, until all bytes arrived. Raises ConnectionError on EOF, OSError on error.
 * recv_frame_head(fd, ...): one data frame's header, and a WRITE frame's run table, read and checked
 *     as kvxfer/wire/frames.py checks them (see the function); optionally polling the socket for a
 *     while before it sleeps in the read (busy_poll below).
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
 * ring_wait / ring_publish / ring_wake: the ring's waiting (a short poll, then a futex on the position
 *     word, announced in a want word so that the publisher wakes only a sleeper) for the Python side.
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
#include <limits.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "kvxfer_guard.h"

#define IOV_BATCH 512
#ifndef SEND_GROUP
/* send_runs hands the kernel this much per sendmsg call. Measured on another host (loopback, 64 KiB
 * pages, checks off, GB/s, three interleaved runs each): 256 KiB 3.1, 512 KiB 3.6, 1 MiB 4.0, 2 MiB
 * 4.3, 4 MiB 3.7, 8 MiB 4.0, and 2.95 for one call of up to 512 runs (32 MiB). On the 2-core
 * development VM of 2026-12-05, once the receiver read in bounded pieces (256 KiB), 1 MiB beat 2 MiB
 * (kvxfer bench, checks off, each engine pinned to a core, four runs each: 4 KiB pages 3.00-3.13
 * against 2.71-2.86 GB/s, 64 KiB pages 3.65-3.76 against 3.23-3.29). The checked path
 * (send_runs_summed) sums each group right after the kernel copied it, from cache: checks on, pinned,
 * 1 MiB 2.28-2.46 GB/s at 4 KiB pages and 3.56-3.74 at 64 KiB (eight runs); 2 MiB 1.95-2.05 and
 * 2.87-2.91, 512 KiB 2.46 and 3.19-3.25 (two runs each). */
#define SEND_GROUP (1u << 20)
#endif
#ifndef RECV_GROUP
/* recv_runs asks readv for at most this much per call (a long run is read across calls). Reading
 * a whole frame (up to 32 MiB) per call was slower on the development VM: the sender waits for the
 * window that each read opens. kvxfer bench, checks off, 64 KiB pages, pinned: 256 KiB reads
 * 3.57-3.90 GB/s (eight runs), 128 KiB 4.54-4.73 (six), 64 KiB 4.67-4.90 (four); unpinned, against
 * the whole-frame reads of before (with 2 MiB sends), 4.20-4.33 against 2.50-2.58 (three alternating
 * runs). */
#define RECV_GROUP (64u << 10)
#endif

/* zlib-ng's checksums, looked up in the zlib_ng Python extension that is already loaded (it exports
 * zng_adler32 / zng_crc32), so items are checksummed in C with the GIL released. algo 0 = Adler-32,
 * 1 = CRC32. */
typedef uint32_t (*checksum_fn)(uint32_t, const uint8_t *, uint32_t);
static checksum_fn checksums[2] = {NULL, NULL};
/* and its combinations: Adler-32 of a concatenation from the pieces' own; CRC32's operator for a
 * piece length (made once per distinct length in a row), applied per piece */
typedef uint32_t (*adler_combine_fn)(uint32_t, uint32_t, int64_t);
typedef uint32_t (*crc_combine_gen_fn)(int64_t);
typedef uint32_t (*crc_combine_op_fn)(uint32_t, uint32_t, const uint32_t);
static adler_combine_fn adler_combine = NULL;
static crc_combine_gen_fn crc_combine_gen = NULL;
static crc_combine_op_fn crc_combine_op = NULL;
static checksum_fn pick_checksum(int algo);

static PyObject *load_zlib_ng(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    void *handle = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (handle == NULL) Py_RETURN_FALSE;
    checksums[0] = (checksum_fn)dlsym(handle, "zng_adler32");
    checksums[1] = (checksum_fn)dlsym(handle, "zng_crc32");
    adler_combine = (adler_combine_fn)dlsym(handle, "zng_adler32_combine");
    crc_combine_gen = (crc_combine_gen_fn)dlsym(handle, "zng_crc32_combine_gen");
    crc_combine_op = (crc_combine_op_fn)dlsym(handle, "zng_crc32_combine_op");
    if (checksums[0] == NULL || checksums[1] == NULL || adler_combine == NULL || crc_combine_gen == NULL ||
        crc_combine_op == NULL) {
        checksums[0] = checksums[1] = NULL;
        adler_combine = NULL;
        crc_combine_gen = NULL;
        crc_combine_op = NULL;
        Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

/* combine_items(algo, initial, values, lengths) -> int: the checksum of the concatenation of pieces,
 * continued from `initial`, where values (uint32) are each piece's own checksum (from the algorithm's
 * start value) and lengths (uint64) their byte counts: zlib-ng's combinations, in C with the GIL
 * released (a 64 MiB request of 4 KiB pages is 16,384 pieces per verification). */
static PyObject *combine_items(PyObject *self, PyObject *args) {
    int algo;
    unsigned long long initial;
    Py_buffer values, lens;
    if (!PyArg_ParseTuple(args, "iKy*y*", &algo, &initial, &values, &lens)) return NULL;
    PyObject *out = NULL;
    if (pick_checksum(algo) == NULL) goto done;
    if (values.len % 4 != 0 || lens.len % 8 != 0 || values.len / 4 != lens.len / 8) {
        PyErr_SetString(PyExc_ValueError, "values must be uint32 and lengths uint64, one per piece");
        goto done;
    }
    size_t n = (size_t)values.len / 4;
    const uint32_t *v = (const uint32_t *)values.buf;
    const uint64_t *l = (const uint64_t *)lens.buf;
    uint32_t acc = (uint32_t)initial;
    for (size_t i = 0; i < n; i++) {
        if (l[i] > (uint64_t)INT64_MAX) {
            PyErr_SetString(PyExc_ValueError, "a piece length does not fit 63 bits");
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    if (algo == 0) {
        for (size_t i = 0; i < n; i++) acc = adler_combine(acc, v[i], (int64_t)l[i]);
    } else {
        uint64_t op_len = 0;
        uint32_t op = 0;
        int have_op = 0;
        for (size_t i = 0; i < n; i++) {
            if (!have_op || l[i] != op_len) {
                op = crc_combine_gen((int64_t)l[i]);
                op_len = l[i];
                have_op = 1;
            }
            acc = crc_combine_op(acc, v[i], op);
        }
    }
    Py_END_ALLOW_THREADS
    out = PyLong_FromUnsignedLong(acc);
done:
    PyBuffer_Release(&values);
    PyBuffer_Release(&lens);
    return out;
}

static checksum_fn pick_checksum(int algo) {
    if (algo < 0 || algo > 1 || checksums[algo] == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "zlib-ng checksums not loaded (call load_zlib_ng first)");
        return NULL;
    }
    return checksums[algo];
}

int native_combine_prepare(int algo, uint64_t len, uint32_t *op) {
    if (pick_checksum(algo) == NULL) return -1;
    if (len > (uint64_t)INT64_MAX) {
        PyErr_SetString(PyExc_ValueError, "a piece length does not fit 63 bits");
        return -1;
    }
    *op = algo == 0 ? 0 : crc_combine_gen((int64_t)len);
    return 0;
}

uint32_t native_combine_step(int algo, uint32_t acc, uint32_t value, uint64_t len, uint32_t op) {
    return algo == 0 ? adler_combine(acc, value, (int64_t)len) : crc_combine_op(acc, value, op);
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

/* Fill runs [first, end) from fd with readv, asking at most `limit` bytes per call (0: as many as
 * the iovecs hold); returns 0, an errno, or -1 for EOF. GIL not held. */
static int recv_range(int fd, const uint64_t *a, const uint64_t *l, size_t first, size_t end, size_t limit) {
    struct iovec iov[IOV_BATCH];
    size_t i = first, off = 0;
    while (i < end) {
        if (l[i] == off) { i++; off = 0; continue; }
        int k = 0;
        size_t j = i, o = off, asked = 0;
        while (j < end && k < IOV_BATCH && (limit == 0 || asked < limit)) {
            size_t len = (size_t)(l[j] - o);
            if (limit && len > limit - asked) len = limit - asked;
            iov[k].iov_base = (char *)(uintptr_t)a[j] + o;
            iov[k].iov_len = len;
            asked += len;
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

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Busy polling of a data socket: a receiving thread about to sleep in a read looks at the socket
 * instead, for up to `spin_ns`, giving the CPU to any other runnable thread between looks
 * (sched_yield), so that a frame sent meanwhile is read without a wake-up: on loopback and on a VM the
 * sleep-and-wake costs tens of microseconds on both sides (the sender's send wakes the sleeper), the
 * look a microsecond. At most BUSY_POLLERS threads of a process poll at once (the others sleep at
 * once): the CPU it costs is bounded by that many cores for `spin_ns` after each frame, whatever the
 * number of connections. Counts, when `counts` is not NULL (three uint64 words, added atomically):
 * [0] data found while polling, [1] polling ran out of time, [2] another thread held the polling. */
#define BUSY_POLLERS 1
static int busy_pollers = 0;

/* Take the process's polling slot (1), or count a skip (0). */
static int busy_poll_begin(uint64_t *counts) {
    if (__atomic_fetch_add(&busy_pollers, 1, __ATOMIC_ACQ_REL) < BUSY_POLLERS) return 1;
    __atomic_fetch_sub(&busy_pollers, 1, __ATOMIC_ACQ_REL);
    if (counts) __atomic_fetch_add(&counts[2], 1, __ATOMIC_RELAXED);
    return 0;
}

/* Give the slot back and count how the polling ended: found (1) or ran out of time (0). */
static void busy_poll_end(int found, uint64_t *counts) {
    __atomic_fetch_sub(&busy_pollers, 1, __ATOMIC_ACQ_REL);
    if (counts) __atomic_fetch_add(&counts[found ? 0 : 1], 1, __ATOMIC_RELAXED);
}

/* Poll the socket until it is readable (data, EOF, an error), for at most spin_ns. GIL not held. */
static void busy_poll(int fd, uint64_t spin_ns, uint64_t *counts) {
    if (spin_ns == 0 || !busy_poll_begin(counts)) return;
    uint64_t start = now_ns();
    int found = 0;
    for (;;) {
        struct pollfd p = {fd, POLLIN, 0};
        if (poll(&p, 1, 0) != 0) { found = 1; break; }  /* data, EOF, an error or a signal: go and read */
        if (now_ns() - start >= spin_ns) break;
        sched_yield();
    }
    busy_poll_end(found, counts);
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
    rc = recv_range(fd, (const uint64_t *)addrs.buf, (const uint64_t *)lens.buf, 0, n, RECV_GROUP);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&addrs);
    PyBuffer_Release(&lens);
    if (rc) return raise_recv(rc);
    Py_RETURN_NONE;
}

/* A WRITE frame's run table (count 24-byte records) within frames.py's check_runs limits (no flags, no
 * empty run, none longer than max_payload, offsets below max_offset), adding up to payload_len. */
static int run_table_ok(const uint8_t *body, uint32_t count, uint64_t payload_len, uint64_t max_payload,
                        uint64_t max_offset) {
    uint64_t added = 0;
    for (uint32_t i = 0; i < count; i++) {
        uint32_t flags;
        uint64_t offset, length;
        memcpy(&flags, body + 24 * (size_t)i + 4, 4);
        memcpy(&offset, body + 24 * (size_t)i + 8, 8);
        memcpy(&length, body + 24 * (size_t)i + 16, 8);
        if (flags != 0 || length == 0 || length > max_payload || offset >= max_offset) return 0;
        added += length;
    }
    return added == payload_len;
}

/* check_run_table(runs, payload_len, max_payload, max_offset) -> bool: run_table_ok on a table already in
 * memory (the shm ring's frames, verbs write logs): True when it passes, False when the Python rules must
 * name what it breaks. */
static PyObject *check_run_table(PyObject *self, PyObject *args) {
    Py_buffer runs;
    unsigned long long payload_len, max_payload, max_offset;
    if (!PyArg_ParseTuple(args, "y*KKK", &runs, &payload_len, &max_payload, &max_offset)) return NULL;
    int ok = runs.len % 24 == 0 && runs.len / 24 <= UINT32_MAX &&
             run_table_ok((const uint8_t *)runs.buf, (uint32_t)(runs.len / 24), payload_len, max_payload, max_offset);
    PyBuffer_Release(&runs);
    return PyBool_FromLong(ok);
}

/* A DONE frame's body (kvxfer/wire/frames.py DONE_FIXED, DONE_BODY_MAX): a 24-byte fixed part, then a
 * request id of at most 2048 bytes and at most 4096 bytes of aux. */
#define DONE_FIXED_BYTES 24u
#define DONE_RID_CHARS 512u
#define DONE_AUX_MAX 4096u
#define DONE_BODY_MAX (DONE_FIXED_BYTES + 4u * DONE_RID_CHARS + DONE_AUX_MAX)

/* A DONE frame's body (frames.py parse_done's rules) as (rid, bytes, pages, checksum, algo, aux): rid an
 * int or a str, algo 1 (adler32) or 2 (crc32). NULL without an exception set for a body that breaks a rule
 * (the caller's Python parser then names it); NULL with one for a failure of this process (memory). */
static PyObject *parse_done_body(const uint8_t *b, uint32_t body_len) {
    uint64_t nbytes;
    uint32_t pages, checksum, aux_len;
    uint16_t rid_len;
    uint8_t algo = b[16], rid_kind = b[17];
    memcpy(&nbytes, b, 8);
    memcpy(&pages, b + 8, 4);
    memcpy(&checksum, b + 12, 4);
    memcpy(&rid_len, b + 18, 2);
    memcpy(&aux_len, b + 20, 4);
    if ((uint64_t)DONE_FIXED_BYTES + rid_len + aux_len != body_len || (algo != 1 && algo != 2) ||
        aux_len > DONE_AUX_MAX)
        return NULL;
    const uint8_t *id = b + DONE_FIXED_BYTES;
    PyObject *rid;
    if (rid_kind == 1) {
        if (rid_len != 8) return NULL;
        uint64_t value;
        memcpy(&value, id, 8);
        rid = PyLong_FromUnsignedLongLong(value);
        if (rid == NULL) return NULL;
    } else if (rid_kind == 2) {
        rid = PyUnicode_DecodeUTF8((const char *)id, rid_len, "strict");
        if (rid == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) return NULL;
            PyErr_Clear();
            return NULL;
        }
        Py_ssize_t chars = PyUnicode_GET_LENGTH(rid);
        if (chars < 1 || chars > DONE_RID_CHARS) {
            Py_DECREF(rid);
            return NULL;
        }
    } else {
        return NULL;
    }
    return Py_BuildValue("(NKIIiy#)", rid, (unsigned long long)nbytes, pages, checksum, (int)algo,
                         (const char *)(id + rid_len), (Py_ssize_t)aux_len);
}

/* A data frame's 32-byte header and what frames.py's parse_header makes of it (status, see recv_frame_head). */
struct frame_head {
    uint8_t h[32];
    int status;
    uint8_t kind;
    uint32_t slot, count, body_len;
    uint64_t gen, payload_len;
};

/* Check fh->h as parse_header does; status 0 (WRITE), 2 (ORDERED of at most max_ordered body bytes), 3 (DONE)
 * when the body is to be read with the header, 1 for another valid header, -1 when it breaks a rule. */
static void check_frame_head(struct frame_head *fh, unsigned int version, unsigned int max_runs, uint64_t max_payload,
                             uint64_t max_message, uint64_t max_ordered) {
    const uint8_t *h = fh->h;
    fh->kind = h[3];
    memcpy(&fh->slot, h + 4, 4);
    memcpy(&fh->gen, h + 8, 8);
    memcpy(&fh->count, h + 16, 4);
    memcpy(&fh->body_len, h + 20, 4);
    memcpy(&fh->payload_len, h + 24, 8);
    uint8_t kind = fh->kind;
    uint32_t count = fh->count, body_len = fh->body_len;
    uint64_t payload_len = fh->payload_len;
    int status = 1;
    if (h[0] != 'K' || h[1] != 'X' || h[2] != version || kind < 1 || (kind > 3 && kind != 5)) status = -1;
    else if (kind == 5) {  /* DONE in its fixed binary layout: its body is read here, parsed by the caller */
        if (count != 0 || payload_len != 0 || body_len <= DONE_FIXED_BYTES || body_len > DONE_BODY_MAX) status = -1;
        else status = 3;
    } else if (kind == 2) {
        if (count < 1 || count > max_runs || (uint64_t)body_len != (uint64_t)count * 24 || payload_len < 1 ||
            payload_len > max_payload)
            status = -1;
        else
            status = 0;
    } else if (count != 0 || payload_len != 0 || body_len < 1 || body_len > max_message) {
        status = -1;
    }
    if (status == 1 && kind == 3 && body_len <= max_ordered) status = 2;  /* its body is read here too */
    fh->status = status;
}

/* Whether the frame's body is read with its header. */
static inline int frame_body_wanted(const struct frame_head *fh) {
    return fh->status == 0 || fh->status == 2 || fh->status == 3;
}

/* The frame head as recv_frame_head returns it, `body` (a new reference: the body read, or NULL when none
 * was) checked first: a WRITE frame's run table against run_table_ok (-2), a DONE body parsed (-3). */
static PyObject *frame_head_result(struct frame_head *fh, PyObject *body, uint64_t max_payload, uint64_t max_offset) {
    if (body != NULL) {
        const uint8_t *b = (const uint8_t *)PyBytes_AS_STRING(body);
        /* an ORDERED frame's body (status 2) is a message: the caller decodes it */
        if (fh->status == 0 && !run_table_ok(b, fh->count, fh->payload_len, max_payload, max_offset)) fh->status = -2;
        if (fh->status == 3) {  /* a DONE frame's body, parsed here: (rid, bytes, pages, checksum, algo, aux) */
            PyObject *done = parse_done_body(b, fh->body_len);
            if (done == NULL && PyErr_Occurred()) {
                Py_DECREF(body);
                return NULL;
            }
            if (done == NULL) fh->status = -3;  /* the Python rules name what is wrong with it */
            else { Py_DECREF(body); body = done; }
        }
    } else {
        body = Py_None;
        Py_INCREF(body);
    }
    return Py_BuildValue("(iiIKIIKy#N)", fh->status, (int)fh->kind, fh->slot, (unsigned long long)fh->gen, fh->count,
                         fh->body_len, (unsigned long long)fh->payload_len, (const char *)fh->h,
                         (Py_ssize_t)sizeof(fh->h), body);
}

/* recv_frame_head(fd, version, max_runs, max_payload, max_message, max_offset[, max_ordered[, spin_ns, counts]])
 *     -> (status, kind, slot, generation, count, body_len, payload_len, header, body)
 * Read one data frame's 32-byte header from a blocking socket (GIL released) and check it as
 * kvxfer/wire/frames.py's parse_header does; for a WRITE frame also read its run table and check it as
 * parse_runs does (no flags, no empty run, none longer than max_payload, offsets below max_offset, the
 * lengths adding up to payload_len). status 0: a WRITE frame, `body` its run table (bytes); 2: an ORDERED
 * frame of at most max_ordered body bytes, `body` its body; 1: another valid header (its body is left in
 * the socket; body None); 3: a DONE frame, `body` its parsed body (parse_done_body's tuple); -1: the
 * header breaks a rule; -2: the run table does; -3: the DONE frame's body does (`body` its bytes). On
 * -1, -2 and -3 the caller runs the Python parser on `header` (and `body`), which names the rule. The
 * twin of parse_header + parse_runs + parse_done: tests/test_frames_native.py and tests/test_done_frames.py
 * hold them equal on random and hostile frames. With spin_ns > 0 the socket is polled that long before
 * the header's read sleeps (busy_poll; counts: the address of its three counters, or 0). */
static PyObject *recv_frame_head(PyObject *self, PyObject *args) {
    int fd;
    unsigned int version, max_runs;
    unsigned long long max_payload, max_message, max_offset, max_ordered = 0, spin_ns = 0, counts_address = 0;
    if (!PyArg_ParseTuple(args, "iIIKKK|KKK", &fd, &version, &max_runs, &max_payload, &max_message, &max_offset,
                          &max_ordered, &spin_ns, &counts_address))
        return NULL;
    if (counts_address % 8) {
        PyErr_SetString(PyExc_ValueError, "recv_frame_head: the busy-poll counts are 8-byte aligned");
        return NULL;
    }
    struct frame_head fh;
    uint64_t a = (uint64_t)(uintptr_t)fh.h, l = sizeof(fh.h);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    busy_poll(fd, spin_ns, (uint64_t *)(uintptr_t)counts_address);
    rc = recv_range(fd, &a, &l, 0, 1, 0);
    Py_END_ALLOW_THREADS
    if (rc) return raise_recv(rc);
    check_frame_head(&fh, version, max_runs, max_payload, max_message, max_ordered);
    PyObject *body = NULL;
    if (frame_body_wanted(&fh)) {
        body = PyBytes_FromStringAndSize(NULL, fh.body_len);
        if (body == NULL) return NULL;
        uint64_t ba = (uint64_t)(uintptr_t)PyBytes_AS_STRING(body), bl = fh.body_len;
        Py_BEGIN_ALLOW_THREADS
        rc = recv_range(fd, &ba, &bl, 0, 1, 0);
        Py_END_ALLOW_THREADS
        if (rc) {
            Py_DECREF(body);
            return raise_recv(rc);
        }
    }
    return frame_head_result(&fh, body, max_payload, max_offset);
}

/* Item checksums (each from `init`) of runs [first, end) into sums[*slot...]. GIL not needed. */
static void sum_items(checksum_fn fn, uint32_t init, const uint64_t *a, const uint64_t *l, const uint64_t *it,
                      size_t first, size_t end, uint32_t *sums, size_t *slot) {
    for (size_t i = first; i < end; i++)
        for (uint64_t off = 0; off < l[i]; off += it[i])
            sums[(*slot)++] = checksum_span(fn, init, (const uint8_t *)(uintptr_t)(a[i] + off), it[i]);
}

/* Land runs [0, n) from fd in groups of about `chunk` bytes, checksumming every item of a group right
 * after it landed (while it is in cache) into sums[]; 0, an errno, or -1 for EOF. GIL not held. */
static int recv_summed(int fd, checksum_fn fn, uint32_t init, const uint64_t *a, const uint64_t *l, const uint64_t *it,
                       size_t n, size_t chunk, uint32_t *sums) {
    size_t first = 0, slot = 0;
    while (first < n) {
        size_t end = first, bytes = 0;
        while (end < n && (end == first || bytes + l[end] <= chunk)) bytes += l[end++];
        int rc = recv_range(fd, a, l, first, end, chunk);
        if (rc) return rc;
        sum_items(fn, init, a, l, it, first, end, sums, &slot);
        first = end;
    }
    return 0;
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
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = recv_summed(fd, fn, (uint32_t)initial, a, l, it, n, (size_t)chunk, sums);
    Py_END_ALLOW_THREADS
    if (rc) { raise_recv(rc); Py_CLEAR(out); }
done:
    PyBuffer_Release(&addrs);
    PyBuffer_Release(&lens);
    PyBuffer_Release(&items);
    return out;
}

/* recv_run_table(fd, runs, bases, item_lens, num_pages, algo, initial, chunk) -> bytes or None
 * A WRITE frame's payload landed straight from its run table (24-byte records <buffer u32, flags u32,
 * offset u64, length u64>, already checked and accepted by the write guard): run i goes to
 * bases[buffer] + offset (bases: one uint64 address per buffer, each buffer num_pages items of
 * item_lens[buffer] bytes, int64 per buffer; a run outside its buffer is a ValueError, whatever the
 * guard said). With algo >= 0, as recv_runs_summed (runs are whole items): returns the item checksums;
 * with algo < 0 only lands (recv_runs) and returns None. The same as computing the addresses, lengths
 * and item lengths in numpy and calling recv_runs(_summed), without the arrays. */
/* A WRITE frame's run table (24-byte records <buffer u32, flags u32, offset u64, length u64>) as three
 * arrays in one allocation (PyMem_Free it): addresses bases[buffer] + offset, lengths, item lengths
 * (items: int64 per buffer; each buffer num_pages items). NULL with ValueError (naming `who`) for a
 * table that is not records, a run outside its buffer or, when `whole`, not whole items; *count is then
 * the number of items. */
static uint64_t *run_table_addresses(Py_buffer *runs, Py_buffer *bases, Py_buffer *items, uint64_t num_pages,
                                     int whole, size_t *n_out, size_t *count, const char *who) {
    size_t n = (size_t)runs->len / 24, nbuf = (size_t)bases->len / 8;
    if (runs->len % 24 || n == 0 || bases->len % 8 || items->len != bases->len || nbuf == 0) {
        PyErr_Format(PyExc_ValueError, "%s: a run table of 24-byte records, one base address and one item length "
                     "per buffer", who);
        return NULL;
    }
    uint64_t *a = (uint64_t *)PyMem_Malloc(3 * n * sizeof(uint64_t));
    if (a == NULL) { PyErr_NoMemory(); return NULL; }
    uint64_t *l = a + n, *it = a + 2 * n;
    const uint8_t *rec = (const uint8_t *)runs->buf;
    const uint64_t *base = (const uint64_t *)bases->buf;
    const int64_t *item = (const int64_t *)items->buf;
    *count = 0;
    for (size_t i = 0; i < n; i++, rec += 24) {
        uint32_t buffer;
        uint64_t offset, length;
        memcpy(&buffer, rec, 4);
        memcpy(&offset, rec + 8, 8);
        memcpy(&length, rec + 16, 8);
        if (buffer >= nbuf || length == 0 || item[buffer] <= 0 || (whole && length % (uint64_t)item[buffer])) {
            PyErr_Format(PyExc_ValueError, "%s: run %zu (buffer %u, %llu bytes) is not whole items of a buffer of "
                         "the layout", who, i, buffer, (unsigned long long)length);
            PyMem_Free(a);
            return NULL;
        }
        uint64_t size = (uint64_t)item[buffer] * num_pages;
        if (num_pages > UINT64_MAX / (uint64_t)item[buffer] || offset > size || length > size - offset) {
            PyErr_Format(PyExc_ValueError, "%s: run %zu (buffer %u, %llu bytes at offset %llu) is outside its "
                         "buffer", who, i, buffer, (unsigned long long)length, (unsigned long long)offset);
            PyMem_Free(a);
            return NULL;
        }
        a[i] = base[buffer] + offset;
        l[i] = length;
        it[i] = (uint64_t)item[buffer];
        *count += whole ? (size_t)(length / it[i]) : 0;
    }
    *n_out = n;
    return a;
}

static PyObject *recv_run_table(PyObject *self, PyObject *args) {
    int fd, algo;
    Py_buffer runs, bases, items;
    unsigned long long initial, chunk, num_pages;
    if (!PyArg_ParseTuple(args, "iy*y*y*KiKK", &fd, &runs, &bases, &items, &num_pages, &algo, &initial, &chunk))
        return NULL;
    PyObject *out = NULL;
    uint64_t *a = NULL;
    size_t n = 0, count = 0;
    checksum_fn fn = NULL;
    if (algo >= 0 && (fn = pick_checksum(algo)) == NULL) goto done;
    if ((a = run_table_addresses(&runs, &bases, &items, num_pages, fn != NULL, &n, &count, "recv_run_table")) == NULL)
        goto done;
    uint64_t *l = a + n, *it = a + 2 * n;
    int rc = 0;
    if (fn == NULL) {
        Py_BEGIN_ALLOW_THREADS
        rc = recv_range(fd, a, l, 0, n, RECV_GROUP);
        Py_END_ALLOW_THREADS
        if (rc) raise_recv(rc);
        else { out = Py_None; Py_INCREF(out); }
        goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)count * 4);
    if (out == NULL) goto done;
    uint32_t *sums = (uint32_t *)PyBytes_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS
    rc = recv_summed(fd, fn, (uint32_t)initial, a, l, it, n, (size_t)chunk, sums);
    Py_END_ALLOW_THREADS
    if (rc) { raise_recv(rc); Py_CLEAR(out); }
done:
    PyMem_Free(a);
    PyBuffer_Release(&runs);
    PyBuffer_Release(&bases);
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

/* The arguments of send_runs and send_runs_nowait: (fd, prefix, addresses, lengths), the runs checked;
 * -1 with an exception set and nothing held. */
static int send_args(PyObject *args, int *fd, Py_buffer *prefix, Py_buffer *addrs, Py_buffer *lens, size_t *n) {
    if (!PyArg_ParseTuple(args, "iy*y*y*", fd, prefix, addrs, lens)) return -1;
    if (parse_runs(addrs, lens, n) < 0) {
        PyBuffer_Release(prefix);
        PyBuffer_Release(addrs);
        PyBuffer_Release(lens);
        return -1;
    }
    return 0;
}

static PyObject *send_runs(PyObject *self, PyObject *args) {
    int fd;
    Py_buffer prefix, addrs, lens;
    size_t n;
    if (send_args(args, &fd, &prefix, &addrs, &lens, &n) < 0) return NULL;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    const uint64_t *l = (const uint64_t *)lens.buf;
    size_t first = 0;
    int with_prefix = 1;
    while ((first < n || with_prefix) && err == 0) {  /* groups of about SEND_GROUP bytes, as send_runs_summed */
        size_t end = first, bytes = 0;
        while (end < n && (end == first || bytes + l[end] <= SEND_GROUP)) bytes += l[end++];
        err = send_range(fd, (const char *)prefix.buf, with_prefix ? (size_t)prefix.len : 0,
                         (const uint64_t *)addrs.buf, l, first, end);
        with_prefix = 0;
        first = end;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&prefix);
    PyBuffer_Release(&addrs);
    PyBuffer_Release(&lens);
    if (err) { errno = err; return PyErr_SetFromErrno(PyExc_OSError); }
    Py_RETURN_NONE;
}

/* Send the prefix, then runs [0, n), with MSG_DONTWAIT until everything left or the socket's buffer is
 * full (EAGAIN); adds the bytes that left to *total. Returns 0 or an errno (never EAGAIN). GIL not held. */
static int send_nowait(int fd, const char *prefix, size_t prefix_len, const uint64_t *a, const uint64_t *l, size_t n,
                       unsigned long long *total) {
    /* piece i: -1 is the prefix, then the runs; `off` bytes of piece i are gone */
    long i = -1;
    size_t off = 0;
    for (;;) {
        while (i < (long)n && (i < 0 ? prefix_len : (size_t)l[i]) == off) { i++; off = 0; }
        if (i >= (long)n) return 0;
        struct iovec iov[IOV_BATCH];
        int k = 0;
        for (long j = i; j < (long)n && k < IOV_BATCH; j++) {
            const char *base = j < 0 ? prefix : (const char *)(uintptr_t)a[j];
            size_t len = j < 0 ? prefix_len : (size_t)l[j];
            size_t skip = j == i ? off : 0;
            if (len > skip) {
                iov[k].iov_base = (void *)(base + skip);
                iov[k].iov_len = len - skip;
                k++;
            }
        }
        if (k == 0) return 0;
        struct msghdr msg;
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = iov;
        msg.msg_iovlen = (size_t)k;
        ssize_t r = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (r < 0) {
            if (errno == EINTR) continue;
            return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : errno;
        }
        *total += (unsigned long long)r;
        size_t sent = (size_t)r;
        while (sent > 0 && i < (long)n) {
            size_t left = (i < 0 ? prefix_len : (size_t)l[i]) - off;
            if (sent >= left) { sent -= left; i++; off = 0; }
            else { off += sent; sent = 0; }
        }
    }
}

/* send_runs_nowait(fd, prefix, addresses, lengths) -> int
 * Like send_runs, but never waits for room in the socket: sendmsg with MSG_DONTWAIT until everything
 * left or the socket's buffer is full (EAGAIN), and returns how many bytes (prefix first) left. The
 * caller hands the rest to a thread that may block (a small request posted from the caller's thread,
 * kvxfer/transport/tcp.py). Other errors raise OSError. */
static PyObject *send_runs_nowait(PyObject *self, PyObject *args) {
    int fd;
    Py_buffer prefix, addrs, lens;
    size_t n;
    if (send_args(args, &fd, &prefix, &addrs, &lens, &n) < 0) return NULL;
    int err;
    unsigned long long total = 0;
    Py_BEGIN_ALLOW_THREADS
    err = send_nowait(fd, (const char *)prefix.buf, (size_t)prefix.len, (const uint64_t *)addrs.buf,
                      (const uint64_t *)lens.buf, n, &total);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&prefix);
    PyBuffer_Release(&addrs);
    PyBuffer_Release(&lens);
    if (err) { errno = err; return PyErr_SetFromErrno(PyExc_OSError); }
    return PyLong_FromUnsignedLongLong(total);
}

/* send_summed_done(fd, addresses, lengths, item_lens, algo, initial, done, sum_at) -> (int, int)
 * A small request's DONE, sent right behind its WRITE frame (which the caller sent first, so the
 * receiver lands it meanwhile): every item's checksum (the runs are whole items of item_lens[i] bytes,
 * each summed from `initial`) combined in order into the request's checksum, stored little-endian at
 * done[sum_at:sum_at + 4] (a DONE frame built with checksum 0: its checksum field), then the DONE frame
 * sent without waiting for the socket (as send_runs_nowait). Returns (bytes of the DONE frame that
 * left, the checksum); the caller sends the rest. Errors other than a full socket raise OSError. */
static PyObject *send_summed_done(PyObject *self, PyObject *args) {
    int fd, algo;
    Py_buffer addrs, lens, items, done;
    unsigned long long initial;
    Py_ssize_t sum_at;
    size_t n;
    if (!PyArg_ParseTuple(args, "iy*y*y*iKw*n", &fd, &addrs, &lens, &items, &algo, &initial, &done, &sum_at))
        return NULL;
    PyObject *out = NULL;
    checksum_fn fn = pick_checksum(algo);
    if (fn == NULL || summed_items(&addrs, &lens, &items, &n) < 0) goto end;
    if (algo == 1 && crc_combine_gen == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "zlib-ng's crc32 combination not loaded");
        goto end;
    }
    for (size_t i = 0; i < n; i++) {
        if (((const uint64_t *)items.buf)[i] > (uint64_t)INT64_MAX) {
            PyErr_SetString(PyExc_ValueError, "an item length does not fit 63 bits");
            goto end;
        }
    }
    if (sum_at < 0 || done.len < 4 || sum_at > done.len - 4) {
        PyErr_SetString(PyExc_ValueError, "sum_at is outside the DONE frame");
        goto end;
    }
    int err;
    unsigned long long done_sent = 0;
    uint32_t acc = (uint32_t)initial;
    Py_BEGIN_ALLOW_THREADS
    const uint64_t *a = (const uint64_t *)addrs.buf, *l = (const uint64_t *)lens.buf, *it = (const uint64_t *)items.buf;
    uint64_t op_len = 0;
    uint32_t op = 0;
    for (size_t i = 0; i < n; i++) {
        if (algo == 1 && it[i] != op_len) {
            op = crc_combine_gen((int64_t)it[i]);
            op_len = it[i];
        }
        for (uint64_t off = 0; off < l[i]; off += it[i]) {
            uint32_t sum = checksum_span(fn, (uint32_t)initial, (const uint8_t *)(uintptr_t)(a[i] + off), it[i]);
            acc = algo == 0 ? adler_combine(acc, sum, (int64_t)it[i]) : crc_combine_op(acc, sum, op);
        }
    }
    uint8_t *field = (uint8_t *)done.buf + sum_at;
    for (int k = 0; k < 4; k++) field[k] = (uint8_t)(acc >> (8 * k));
    err = send_nowait(fd, (const char *)done.buf, (size_t)done.len, NULL, NULL, 0, &done_sent);
    Py_END_ALLOW_THREADS
    if (err) { errno = err; PyErr_SetFromErrno(PyExc_OSError); goto end; }
    out = Py_BuildValue("Kk", done_sent, (unsigned long)acc);
end:
    PyBuffer_Release(&addrs);
    PyBuffer_Release(&lens);
    PyBuffer_Release(&items);
    PyBuffer_Release(&done);
    return out;
}

/* send_runs_summed(fd, prefix, addresses, lengths, item_lens, algo, initial, chunk) -> bytes
 * Like send_runs, in groups of about `chunk` bytes: each group's item checksums are computed just
 * after the group was sent, from the cache the kernel's copy into the socket filled. (Summing first
 * makes the checksum take the cache misses of scattered pages, which the hardware prefetcher does
 * not cross: measured on 4 KiB pages, zlib-ng's Adler-32 then ran at ~5 GB/s against the kernel
 * copy's ~7 GB/s from DRAM.) The pages are the sender's for the whole call, so before or after is
 * the same bytes. Returns uint32 sums. */
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
        err = send_range(fd, (const char *)prefix.buf, with_prefix ? (size_t)prefix.len : 0, a, l, first, end);
        if (err == 0) sum_items(fn, (uint32_t)initial, a, l, it, first, end, sums, &slot);
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

/* send_frames(fd, prefixes, prefix_ends, run_ends, addresses, lengths, item_lens, algo, initial, chunk)
 *   -> bytes or None
 * Several frames in one call, the GIL released throughout: frame f is prefixes[prefix_ends[f-1]:
 * prefix_ends[f]] (its header and run table) followed by runs [run_ends[f-1], run_ends[f]), each
 * frame's runs sent in groups of about `chunk` bytes as send_runs_summed sends them. With algo >= 0 the
 * item checksums of every group are taken right after it went (item_lens: one per run), returned as
 * uint32 in run order; with algo -1, item_lens may be empty and None is returned. A frame has at least
 * one run; the ends are cumulative and end at the arrays' ends. An error raises OSError: how much of
 * the frames left is unknown, and the connection is to be ended. */
static PyObject *send_frames(PyObject *self, PyObject *args) {
    int fd, algo;
    Py_buffer prefixes, pends, rends, addrs, lens, items;
    unsigned long long initial, chunk;
    if (!PyArg_ParseTuple(args, "iy*y*y*y*y*y*iKK", &fd, &prefixes, &pends, &rends, &addrs, &lens, &items, &algo,
                          &initial, &chunk))
        return NULL;
    PyObject *out = NULL;
    size_t n = 0;
    checksum_fn fn = NULL;
    Py_ssize_t count = 0;
    if (algo >= 0) {
        fn = pick_checksum(algo);
        count = fn == NULL ? -1 : summed_items(&addrs, &lens, &items, &n);
        if (count < 0) goto done;
    } else if (parse_runs(&addrs, &lens, &n) < 0) {
        goto done;
    }
    if (pends.len != rends.len || pends.len % 8 != 0 || pends.len == 0) {
        PyErr_SetString(PyExc_ValueError, "prefix_ends and run_ends must be uint64 arrays of one entry per frame");
        goto done;
    }
    size_t frames = (size_t)pends.len / 8;
    const uint64_t *pe = (const uint64_t *)pends.buf, *re = (const uint64_t *)rends.buf;
    for (size_t f = 0; f < frames; f++) {
        uint64_t p0 = f ? pe[f - 1] : 0, r0 = f ? re[f - 1] : 0;
        if (pe[f] < p0 || re[f] <= r0) {
            PyErr_SetString(PyExc_ValueError, "frame ends must grow, and every frame has a run");
            goto done;
        }
    }
    if (pe[frames - 1] != (uint64_t)prefixes.len || re[frames - 1] != (uint64_t)n) {
        PyErr_SetString(PyExc_ValueError, "the last frame must end at the end of prefixes and of the runs");
        goto done;
    }
    uint32_t *sums = NULL;
    if (fn != NULL) {
        out = PyBytes_FromStringAndSize(NULL, count * 4);
        if (out == NULL) goto done;
        sums = (uint32_t *)PyBytes_AS_STRING(out);
    }
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    const uint64_t *a = (const uint64_t *)addrs.buf, *l = (const uint64_t *)lens.buf, *it = (const uint64_t *)items.buf;
    const char *pre = (const char *)prefixes.buf;
    size_t slot = 0;
    for (size_t f = 0; f < frames && err == 0; f++) {
        size_t first = f ? (size_t)re[f - 1] : 0, last = (size_t)re[f];
        size_t p0 = f ? (size_t)pe[f - 1] : 0;
        int with_prefix = 1;
        while (first < last && err == 0) {
            size_t end = first, bytes = 0;
            while (end < last && (end == first || bytes + l[end] <= chunk)) bytes += l[end++];
            err = send_range(fd, pre + p0, with_prefix ? (size_t)pe[f] - p0 : 0, a, l, first, end);
            if (err == 0 && sums != NULL) sum_items(fn, (uint32_t)initial, a, l, it, first, end, sums, &slot);
            with_prefix = 0;
            first = end;
        }
    }
    Py_END_ALLOW_THREADS
    if (err) { errno = err; PyErr_SetFromErrno(PyExc_OSError); Py_CLEAR(out); goto done; }
    if (out == NULL) { out = Py_None; Py_INCREF(out); }
done:
    PyBuffer_Release(&prefixes);
    PyBuffer_Release(&pends);
    PyBuffer_Release(&rends);
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

/* Waiting on the shm ring: futexes on the positions themselves.
 *
 * A side that waits for the other's position (the reader for the producer position, the writer for
 * the consumer position) polls it for RING_SPIN_NS, then announces what it waits for in its *want*
 * word (a ring header word of its own: the position it needs, 0 when it does not sleep) and sleeps in
 * FUTEX_WAIT on the position word's low 32 bits (the futex is shared, not _PRIVATE: the ring is a
 * file mapped by two processes), at most RING_SLEEP_NS at a time. A side that publishes its position
 * (store-release, then a full fence) looks at the other side's want word and, only when the new
 * position satisfies it, clears it and issues FUTEX_WAKE: no system call while nobody sleeps. The
 * fence pairs with the waiter's sequentially consistent store of its want word before its last look
 * at the position (a waiter sees the new position or the publisher sees the want word; FUTEX_WAIT
 * itself refuses to sleep if the position moved since that look). Whoever changes a state word
 * (FENCED, CLOSED) wakes both position words (ring_wake). A sleep is bounded, so a state change or a
 * peer's death is noticed within RING_SLEEP_NS even without a wake (an aborting writer's private
 * abort word, a peer killed mid-publish).
 *
 * Without a want word (want_address 0) nobody wakes the waiter: it sleeps in short timed futex waits
 * doubling from 20 us to 1 ms, the previous polling. */
#ifndef RING_SPIN_NS
#define RING_SPIN_NS 4000ull /* polling before a waiting side sleeps: the other side often publishes within microseconds */
#endif
#ifndef RING_WRITER_SLACK
#define RING_WRITER_SLACK 4 /* a waiting writer is woken once 1/RING_WRITER_SLACK of the ring is free */
#endif
#ifndef RING_READER_SLACK
#define RING_READER_SLACK 2 /* a waiting reader is woken once 1/RING_READER_SLACK of the ring more is published */
#endif
#define RING_SLEEP_NS 10000000ull /* the longest one sleep: states and the peer's process are looked at this often */
#define RING_LIVENESS_NS 500000000ull /* a waiting side checks that the peer's process exists this often */


/* The 32-bit futex word of a 64-bit position: its low half. */
static inline uint32_t *futex_word(const uint64_t *word) {
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return (uint32_t *)(uintptr_t)word + 1;
#else
    return (uint32_t *)(uintptr_t)word;
#endif
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Publish `value` at `word` (store-release) and wake the other side if it sleeps for at most that. */
static inline void ring_publish_word(uint64_t *word, uint64_t value, uint64_t *want) {
    __atomic_store_n(word, value, __ATOMIC_RELEASE);
    if (want == NULL) return;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    uint64_t t = __atomic_load_n(want, __ATOMIC_RELAXED);
    if (t != 0 && value >= t && __atomic_compare_exchange_n(want, &t, 0, 0, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED))
        syscall(SYS_futex, futex_word(word), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Until the word at `word` (load-acquire) reaches `target`: 0. Early: 1 when *stop == stop_value, 2
 * when *closed == closed_value and the wait is still unmet, 3 when pid > 0 and that process no longer
 * exists (looked at every RING_LIVENESS_NS), 4 when timeout_ns > 0 passed. A sleep is announced as
 * `want_value` (>= target; more than target lets the other side get further before it wakes this
 * one, and must be a position the other side reaches without this side moving). GIL not held. */
static int ring_wait(const uint64_t *word, int64_t target, uint64_t *want, uint64_t want_value, const uint64_t *stop,
                     uint64_t stop_value, const uint64_t *closed, uint64_t closed_value, long pid, uint64_t timeout_ns) {
    if ((int64_t)__atomic_load_n(word, __ATOMIC_ACQUIRE) >= target) return 0;
    uint64_t start = now_ns(), t = start, next_check = start + RING_LIVENESS_NS;
    while (t - start < RING_SPIN_NS) {
        for (int i = 0; i < 64; i++) {
            if ((int64_t)__atomic_load_n(word, __ATOMIC_ACQUIRE) >= target) return 0;
            cpu_relax();
        }
        t = now_ns();
    }
    long backoff_ns = 20000;
    int rc = 0;
    for (;;) {
        if (__atomic_load_n(stop, __ATOMIC_ACQUIRE) == stop_value) { rc = 1; break; }
        if (__atomic_load_n(closed, __ATOMIC_ACQUIRE) == closed_value) {
            rc = (int64_t)__atomic_load_n(word, __ATOMIC_ACQUIRE) >= target ? 0 : 2;
            break;
        }
        if (pid > 0 && t >= next_check) {
            next_check = t + RING_LIVENESS_NS;
            if (kill((pid_t)pid, 0) != 0 && errno == ESRCH) { rc = 3; break; }
        }
        uint64_t sleep_ns = want != NULL ? RING_SLEEP_NS : (uint64_t)backoff_ns;
        if (timeout_ns) {
            if (t - start >= timeout_ns) { rc = 4; break; }
            if (timeout_ns - (t - start) < sleep_ns) sleep_ns = timeout_ns - (t - start);
        }
        if (want != NULL) __atomic_store_n(want, want_value, __ATOMIC_SEQ_CST);
        uint64_t seen = __atomic_load_n(word, __ATOMIC_SEQ_CST);
        if ((int64_t)seen >= target) break;
        struct timespec ts = {(time_t)(sleep_ns / 1000000000ull), (long)(sleep_ns % 1000000000ull)};
        syscall(SYS_futex, futex_word(word), FUTEX_WAIT, (uint32_t)seen, &ts, NULL, 0);
        if ((int64_t)__atomic_load_n(word, __ATOMIC_ACQUIRE) >= target) break;
        if (backoff_ns < 1000000) backoff_ns = backoff_ns * 2 > 1000000 ? 1000000 : backoff_ns * 2;
        t = now_ns();
    }
    if (want != NULL) __atomic_store_n(want, 0, __ATOMIC_RELEASE);
    return rc;
}

static int ring_word_arg(unsigned long long address, const char *what) {
    if (address % 8) {
        PyErr_Format(PyExc_ValueError, "ring words are 8-byte aligned (%s)", what);
        return -1;
    }
    return 0;
}

/* busy_poll for the shm ring: look at the position word until it reaches target (or the stop or closed
 * word takes its value: found, the caller looks), for at most spin_ns. GIL not held. */
static void busy_poll_word(const uint64_t *word, int64_t target, const uint64_t *stop, uint64_t stop_value,
                           const uint64_t *closed, uint64_t closed_value, uint64_t spin_ns, uint64_t *counts) {
    if (spin_ns == 0 || !busy_poll_begin(counts)) return;
    uint64_t start = now_ns();
    int found = 0;
    for (;;) {
        for (int i = 0; i < 64 && !found; i++) {
            found = (int64_t)__atomic_load_n(word, __ATOMIC_ACQUIRE) >= target ||
                    __atomic_load_n(stop, __ATOMIC_ACQUIRE) == stop_value ||
                    __atomic_load_n(closed, __ATOMIC_ACQUIRE) == closed_value;
            cpu_relax();
        }
        if (found || now_ns() - start >= spin_ns) break;
        sched_yield();
    }
    busy_poll_end(found, counts);
}

/* ring_wait(address, target, want_address, stop_address, stop_value, closed_address, closed_value, pid,
 *           timeout[, spin_ns, counts]) -> rc
 * Wait, with the GIL released, until the 64-bit word at `address` reaches `target`, sleeping in a
 * futex announced in the word at want_address (0: no announcement, timed sleeps). rc as ring_wait
 * above: 0 reached, 1 stopped, 2 closed and unmet, 3 the process `pid` is gone, 4 `timeout` seconds
 * passed (0: no timeout). With spin_ns > 0 it busy polls first (busy_poll_word; counts: the address of
 * its three counters, or 0). */
static PyObject *py_ring_wait(PyObject *self, PyObject *args) {
    unsigned long long address, want_address, stop_address, stop_value, closed_address, closed_value;
    unsigned long long spin_ns = 0, counts_address = 0;
    long long target;
    long pid;
    double timeout;
    if (!PyArg_ParseTuple(args, "KLKKKKKld|KK", &address, &target, &want_address, &stop_address, &stop_value,
                          &closed_address, &closed_value, &pid, &timeout, &spin_ns, &counts_address))
        return NULL;
    if (ring_word_arg(address | want_address | stop_address | closed_address | counts_address, "ring_wait") < 0)
        return NULL;
    if (address == 0 || stop_address == 0 || closed_address == 0) {
        PyErr_SetString(PyExc_ValueError, "ring_wait needs the position, stop and closed words");
        return NULL;
    }
    uint64_t timeout_ns = timeout > 0 ? (uint64_t)(timeout * 1e9) : 0;
    if (timeout > 0 && timeout_ns == 0) timeout_ns = 1;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    busy_poll_word((const uint64_t *)(uintptr_t)address, (int64_t)target, (const uint64_t *)(uintptr_t)stop_address,
                   stop_value, (const uint64_t *)(uintptr_t)closed_address, closed_value, spin_ns,
                   (uint64_t *)(uintptr_t)counts_address);
    rc = ring_wait((const uint64_t *)(uintptr_t)address, (int64_t)target, (uint64_t *)(uintptr_t)want_address,
                   (uint64_t)target, (const uint64_t *)(uintptr_t)stop_address, stop_value, (const uint64_t *)(uintptr_t)closed_address,
                   closed_value, pid, timeout_ns);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

/* ring_publish(address, value, want_address): store-release `value` at `address` and, when the word
 * at want_address (0: none) asks for at most `value`, clear it and wake the sleeper. */
static PyObject *py_ring_publish(PyObject *self, PyObject *args) {
    unsigned long long address, value, want_address;
    if (!PyArg_ParseTuple(args, "KKK", &address, &value, &want_address)) return NULL;
    if (ring_word_arg(address | want_address, "ring_publish") < 0) return NULL;
    ring_publish_word((uint64_t *)(uintptr_t)address, value, (uint64_t *)(uintptr_t)want_address);
    Py_RETURN_NONE;
}

/* ring_wake(address): wake every side sleeping on the position word at `address` (after a state
 * change: FENCED, CLOSED). */
static PyObject *py_ring_wake(PyObject *self, PyObject *args) {
    unsigned long long address;
    if (!PyArg_ParseTuple(args, "K", &address)) return NULL;
    if (ring_word_arg(address, "ring_wake") < 0) return NULL;
    syscall(SYS_futex, futex_word((const uint64_t *)(uintptr_t)address), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
    Py_RETURN_NONE;
}

/* ring_copy's one-pass copy for Adler-32 items of at least RING_FUSED_MIN bytes: each 32-byte block
 * is loaded once, stored and summed from the register (AVX2), so the checksum is of exactly the
 * bytes stored. The reader stores into the pages non-temporally (`nt`): a gigabyte of landed pages
 * then does not evict the ring, nor the Python and numpy state the landing thread needs between
 * frames, from the caches, and their lines are not read before being overwritten; it fences
 * (sfence) before it returns. Measured on the bench host (2 CPUs, 64 KiB pages): a tenth less CPU
 * per transfer. With smaller items (4 KiB) the one-pass loop is slower than memcpy followed by
 * zlib-ng's checksum, which stays their path, as for CRC32 and CPUs without AVX2. */
#if defined(__x86_64__)
#include <immintrin.h>
#define ADLER_BASE 65521u
#define ADLER_NMAX 5552u

static uint32_t adler_copy_scalar(uint32_t adler, uint8_t *dst, const uint8_t *src, size_t len) {
    uint32_t a = adler & 0xffff, b = adler >> 16;
    while (len) {
        size_t n = len < ADLER_NMAX ? len : ADLER_NMAX;
        len -= n;
        for (size_t i = 0; i < n; i++) {
            uint8_t c = src[i];
            dst[i] = c;
            a += c;
            b += a;
        }
        src += n;
        dst += n;
        a %= ADLER_BASE;
        b %= ADLER_BASE;
    }
    return a | (b << 16);
}

__attribute__((target("avx2"))) static inline uint32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return (uint32_t)_mm_cvtsi128_si32(s);
}

__attribute__((target("avx2"))) static uint32_t adler_copy_avx2(uint32_t adler, uint8_t *dst, const uint8_t *src,
                                                                 size_t len, int nt) {
    uint32_t a = adler & 0xffff, b = adler >> 16;
    if (nt && ((uintptr_t)dst & 31)) {  /* align the destination for the streaming stores */
        size_t head = 32 - ((uintptr_t)dst & 31);
        if (head > len) head = len;
        uint32_t v = adler_copy_scalar(a | (b << 16), dst, src, head);
        a = v & 0xffff, b = v >> 16;
        dst += head, src += head, len -= head;
    }
    const __m256i dot = _mm256_setr_epi8(32, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14,
                                         13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1);
    const __m256i ones = _mm256_set1_epi16(1), zero = _mm256_setzero_si256();
    while (len >= 32) {
        size_t n = (len < ADLER_NMAX ? len : ADLER_NMAX) & ~(size_t)31;
        len -= n;
        __m256i s1 = zero, s2 = zero, s3 = zero;
        for (size_t k = 0; k < n; k += 32) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(src + k));
            if (nt)
                _mm256_stream_si256((__m256i *)(dst + k), v);
            else
                _mm256_storeu_si256((__m256i *)(dst + k), v);
            s3 = _mm256_add_epi32(s3, s1);
            s1 = _mm256_add_epi32(s1, _mm256_sad_epu8(v, zero));
            s2 = _mm256_add_epi32(s2, _mm256_madd_epi16(_mm256_maddubs_epi16(v, dot), ones));
        }
        src += n;
        dst += n;
        s2 = _mm256_add_epi32(s2, _mm256_slli_epi32(s3, 5));
        uint64_t sum1 = hsum_epi32(s1), sum2 = hsum_epi32(s2);
        b = (uint32_t)((b + (uint64_t)a * n + sum2) % ADLER_BASE);
        a = (uint32_t)((a + sum1) % ADLER_BASE);
    }
    return len ? adler_copy_scalar(a | (b << 16), dst, src, len) : (a | (b << 16));
}
#endif

#ifndef RING_FUSED_MIN
#define RING_FUSED_MIN (32u << 10)
#endif

/* ring_copy(addresses, lengths, item_lens, algo, initial, chunk, ring_data, ring_size, position, ring_is_src,
 *           wait_address, publish_address, stop_address, stop_value, closed_address, closed_value, pid
 *           [, want_address, peer_want_address]) -> (rc, sums or None)
 *
 * The shm transport's payload copy, streamed through a single-producer/single-consumer byte ring of
 * ring_size bytes at ring_data. The runs (addresses[i], lengths[i]) are the pages' side; the ring
 * side is one byte stream starting at stream position `position` (ring offset position % ring_size,
 * wrapping at the end). ring_is_src = 1: the reader, ring -> pages; 0: the writer, pages -> ring.
 *
 * Before the piece that ends at stream offset e it waits until the 64-bit word at wait_address
 * (load-acquire) reaches position + e (reader: the producer position) or position + e - ring_size
 * (writer: the consumer position, i.e. room); after every `chunk` bytes, before it waits and at
 * the end it publishes position + e at publish_address (its own position; store-release, waking the
 * other side when the word at peer_want_address asks for it). Pieces are at most `chunk`
 * bytes of whole items; with algo >= 0 every item of the pages' side is checksummed (each from
 * `initial`) right after its piece was copied (still in cache): for the reader that is what landed,
 * as recv_runs_summed returns it; for the writer what it sent, as send_runs_summed.
 *
 * It waits as ring_wait above (a short poll, then futex sleeps announced at want_address; without
 * want_address, timed sleeps of 20 us to 1 ms) and returns early: rc 1 when the word at stop_address
 * equals stop_value (the ring was fenced), rc 2 when the word at closed_address equals closed_value
 * and the wait is still unmet (the writer closed, or the link was aborted), rc 3 when pid > 0 and
 * that process no longer exists (checked every 0.5 s). rc 0: every byte was copied and published.
 * The GIL is released throughout. The caller guarantees the pages' runs lie in memory it owns (the
 * write guard checked them) and the ring mapping outlives the call. */
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

/* One side of a ring_copy: the ring, where its stream stands and the words it waits on and publishes. */
struct ring_side {
    uint8_t *ring;
    uint64_t size, position;
    int ring_is_src;
    const uint64_t *wait, *stop, *closed;
    uint64_t *publish, *want, *peer_want;
    uint64_t stop_value, closed_value;
    long pid;
};

/* ring_copy's work on runs already turned into addresses (a), lengths (l) and item lengths (it): rc as
 * ring_copy; `sums` (one per item of the runs, when fn is not NULL) filled. GIL not held. */
static int ring_copy_runs(const struct ring_side *r, const uint64_t *a, const uint64_t *l, const uint64_t *it,
                          size_t n, checksum_fn fn, int algo, uint64_t initial, uint64_t chunk, uint32_t *sums) {
    uint8_t *ring = r->ring;
    uint64_t ring_size = r->size, position = r->position;
    int ring_is_src = r->ring_is_src;
    int64_t lag = ring_is_src ? 0 : (int64_t)ring_size;  /* the writer waits for room, the reader for data */
    int rc = 0;
    uint64_t e = 0, unpublished = 0;
#if defined(__x86_64__)
    uint32_t running = 0;  /* the Adler-32 of the item being copied in one pass */
    int streamed = 0;      /* non-temporal stores were issued: fence before returning */
    int fused = fn != NULL && algo == 0 && __builtin_cpu_supports("avx2");
#else
    (void)algo;
#endif
    uint64_t step = chunk < ring_size ? chunk : ring_size;  /* never wait for more than the ring holds */
    size_t slot = 0;
    uint64_t total = 0;  /* the stream bytes this call moves: the writer publishes all of them */
    for (size_t i = 0; i < n; i++) total += l[i];
    for (size_t i = 0; i < n && rc == 0; i++) {
        /* pieces of whole items when an item fits a step (checksummed right after their copy), else
         * of a step, an item then checksummed once its last piece landed */
        uint64_t piece = step, summed = 0;
        if (fn != NULL && it[i] <= step) piece = step / it[i] * it[i];
        for (uint64_t off = 0; off < l[i]; off += piece) {
            uint64_t len = l[i] - off < piece ? l[i] - off : piece;
            int64_t target = (int64_t)(position + e + len) - lag;
            if ((int64_t)__atomic_load_n(r->wait, __ATOMIC_ACQUIRE) < target) {
                /* about to wait for the other side: it may be waiting for what we have not published */
                if (unpublished) {
                    ring_publish_word(r->publish, position + e, r->peer_want);
                    unpublished = 0;
                }
                /* the writer asks to be woken only once a share of the ring is free (fewer, larger
                 * refills; the reader still has the rest to work on): the reader consumes all that
                 * was published, so it gets there */
                uint64_t slack = ring_size / (ring_is_src ? RING_READER_SLACK : RING_WRITER_SLACK);
                if (slack > ring_size - len) slack = ring_size - len;
                if (ring_is_src && slack > total - e - len) slack = total - e - len;
                rc = ring_wait(r->wait, target, r->want, (uint64_t)target + slack, r->stop, r->stop_value, r->closed,
                               r->closed_value, r->pid, 0);
                if (rc) break;
            }
            uint8_t *pages = (uint8_t *)(uintptr_t)(a[i] + off);
#if defined(__x86_64__)
            if (fused && it[i] >= RING_FUSED_MIN) {
                for (uint64_t done = 0; done < len;) {  /* item by item, each in up to two parts (the ring wraps) */
                    uint64_t in_item = (off + done) % it[i], seg = it[i] - in_item;
                    if (seg > len - done) seg = len - done;
                    if (in_item == 0) running = (uint32_t)initial;
                    for (uint64_t k = 0; k < seg;) {
                        uint64_t ro = (position + e + done + k) % ring_size;
                        uint64_t part = ring_size - ro < seg - k ? ring_size - ro : seg - k;
                        running = ring_is_src ? adler_copy_avx2(running, pages + done + k, ring + ro, (size_t)part, 1)
                                              : adler_copy_avx2(running, ring + ro, pages + done + k, (size_t)part, 0);
                        k += part;
                    }
                    done += seg;
                    if (in_item + seg == it[i]) sums[slot++] = running;
                }
                streamed |= ring_is_src;
            } else
#endif
            {
                ring_move(ring_is_src, pages, ring, ring_size, (position + e) % ring_size, len);
                if (fn != NULL)
                    for (; summed + it[i] <= off + len; summed += it[i])
                        sums[slot++] = checksum_span(fn, (uint32_t)initial, (const uint8_t *)(uintptr_t)(a[i] + summed), it[i]);
            }
            e += len;
            unpublished += len;
            if (unpublished >= chunk) {
                ring_publish_word(r->publish, position + e, r->peer_want);
                unpublished = 0;
            }
        }
    }
#if defined(__x86_64__)
    if (streamed) _mm_sfence();  /* the landed pages are visible before the caller records them */
#endif
    if (rc == 0 && unpublished) ring_publish_word(r->publish, position + e, r->peer_want);
    return rc;
}

/* ring_copy's and ring_run_table's ring arguments into `r`; -1 with ValueError when they are unusable. */
static int ring_side_args(struct ring_side *r, unsigned long long chunk, unsigned long long ring_data,
                          unsigned long long ring_size, unsigned long long position, int ring_is_src,
                          unsigned long long wait_address, unsigned long long publish_address,
                          unsigned long long stop_address, unsigned long long stop_value,
                          unsigned long long closed_address, unsigned long long closed_value, long pid,
                          unsigned long long want_address, unsigned long long peer_want_address) {
    if (chunk == 0 || ring_data == 0 || ring_size == 0 || ring_size > (1ull << 62) || position > (1ull << 62) ||
        wait_address == 0 || publish_address == 0 || stop_address == 0 || closed_address == 0 ||
        (wait_address | publish_address | stop_address | closed_address | want_address | peer_want_address) % 8) {
        PyErr_SetString(PyExc_ValueError, "ring_copy needs a positive chunk and ring size and aligned ring words");
        return -1;
    }
    *r = (struct ring_side){(uint8_t *)(uintptr_t)ring_data, ring_size, position, ring_is_src,
                            (const uint64_t *)(uintptr_t)wait_address, (const uint64_t *)(uintptr_t)stop_address,
                            (const uint64_t *)(uintptr_t)closed_address, (uint64_t *)(uintptr_t)publish_address,
                            (uint64_t *)(uintptr_t)want_address, (uint64_t *)(uintptr_t)peer_want_address,
                            stop_value, closed_value, pid};
    return 0;
}

static PyObject *ring_copy(PyObject *self, PyObject *args) {
    Py_buffer addrs, lens, items;
    int algo, ring_is_src;
    unsigned long long initial, chunk, ring_data, ring_size, position, wait_address, publish_address, stop_address,
        stop_value, closed_address, closed_value, want_address = 0, peer_want_address = 0;
    long pid;
    if (!PyArg_ParseTuple(args, "y*y*y*iKKKKKiKKKKKKl|KK", &addrs, &lens, &items, &algo, &initial, &chunk,
                          &ring_data, &ring_size, &position, &ring_is_src, &wait_address, &publish_address,
                          &stop_address, &stop_value, &closed_address, &closed_value, &pid, &want_address,
                          &peer_want_address))
        return NULL;
    PyObject *out = NULL, *result = NULL;
    size_t n = 0;
    checksum_fn fn = NULL;
    struct ring_side r;
    if (parse_runs(&addrs, &lens, &n) < 0) goto done;
    if (ring_side_args(&r, chunk, ring_data, ring_size, position, ring_is_src, wait_address, publish_address,
                       stop_address, stop_value, closed_address, closed_value, pid, want_address, peer_want_address) < 0)
        goto done;
    if (algo >= 0) {
        fn = pick_checksum(algo);
        Py_ssize_t count = fn == NULL ? -1 : summed_items(&addrs, &lens, &items, &n);
        if (count < 0) goto done;
        out = PyBytes_FromStringAndSize(NULL, count * 4);
        if (out == NULL) goto done;
    }
    uint32_t *sums = out == NULL ? NULL : (uint32_t *)PyBytes_AS_STRING(out);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ring_copy_runs(&r, (const uint64_t *)addrs.buf, (const uint64_t *)lens.buf, (const uint64_t *)items.buf, n, fn,
                        algo, initial, chunk, sums);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(iO)", rc, rc == 0 && out != NULL ? out : Py_None);
done:
    Py_XDECREF(out);
    PyBuffer_Release(&addrs);
    PyBuffer_Release(&lens);
    PyBuffer_Release(&items);
    return result;
}

/* ring_run_table(runs, bases, item_lens, num_pages, algo, initial, chunk, ring_data, ring_size, position,
 *                producer_address, consumer_address, stop_address, stop_value, closed_address, closed_value,
 *                pid, want_address, peer_want_address) -> (rc, sums or None)
 * The shm reader's ring_copy straight from a WRITE frame's run table, as recv_run_table is tcp's: run i
 * lands at bases[buffer] + offset (run_table_addresses' rules: a run outside its buffer is a ValueError,
 * whatever the guard said), with algo >= 0 each item's checksum taken as it landed. rc as ring_copy. The
 * same as computing the addresses, lengths and item lengths in numpy and calling ring_copy. */
static PyObject *ring_run_table(PyObject *self, PyObject *args) {
    Py_buffer runs, bases, items;
    int algo;
    unsigned long long num_pages, initial, chunk, ring_data, ring_size, position, producer_address, consumer_address,
        stop_address, stop_value, closed_address, closed_value, want_address, peer_want_address;
    long pid;
    if (!PyArg_ParseTuple(args, "y*y*y*KiKKKKKKKKKKKlKK", &runs, &bases, &items, &num_pages, &algo, &initial, &chunk,
                          &ring_data, &ring_size, &position, &producer_address, &consumer_address, &stop_address,
                          &stop_value, &closed_address, &closed_value, &pid, &want_address, &peer_want_address))
        return NULL;
    PyObject *out = NULL, *result = NULL;
    uint64_t *a = NULL;
    checksum_fn fn = NULL;
    size_t n = 0, count = 0;
    struct ring_side r;
    if (ring_side_args(&r, chunk, ring_data, ring_size, position, 1, producer_address, consumer_address, stop_address,
                       stop_value, closed_address, closed_value, pid, want_address, peer_want_address) < 0)
        goto done;
    if (algo >= 0 && (fn = pick_checksum(algo)) == NULL) goto done;
    if ((a = run_table_addresses(&runs, &bases, &items, num_pages, fn != NULL, &n, &count, "ring_run_table")) == NULL)
        goto done;
    if (fn != NULL && (out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)count * 4)) == NULL) goto done;
    uint32_t *sums = out == NULL ? NULL : (uint32_t *)PyBytes_AS_STRING(out);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ring_copy_runs(&r, a, a + n, a + 2 * n, n, fn, algo, initial, chunk, sums);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(iO)", rc, rc == 0 && out != NULL ? out : Py_None);
done:
    Py_XDECREF(out);
    PyMem_Free(a);
    PyBuffer_Release(&runs);
    PyBuffer_Release(&bases);
    PyBuffer_Release(&items);
    return result;
}

/* The shm ring's landing thread reading frames: what it needs to wait for, copy out and publish. */
struct ring_reader {
    const uint8_t *data;
    uint64_t size, consumer;
    const uint64_t *producer, *stop, *closed;
    uint64_t *consumer_word, *want, *peer_want;
    uint64_t stop_value, closed_value;
    long pid;
};

#define RING_STOPPED 1      /* the reader's state took stop_value (fenced, withdrawn, closed) */
#define RING_CUT 2          /* the writer closed inside a frame */
#define RING_WRITER_GONE 3  /* the writer's process no longer exists */
#define RING_ENDED 5        /* the writer closed at a frame boundary, nothing left */
#define RING_IMPOSSIBLE 6   /* the producer position is behind the consumer or more than the ring ahead */

/* Until `need` (at most the ring's size) bytes beyond the consumer position are published: 0, or why not
 * (the RING_ codes; RING_ENDED only at a frame `boundary`). Busy polls for spin_ns first when it has to
 * wait. The stop word is looked at first, so a fenced ring that still receives ends at its next frame.
 * GIL not held. */
static int ring_reader_wait(struct ring_reader *r, uint64_t need, int boundary, uint64_t spin_ns, uint64_t *counts) {
    if (__atomic_load_n(r->stop, __ATOMIC_ACQUIRE) == r->stop_value) return RING_STOPPED;
    uint64_t target = r->consumer + need;
    for (int why = 0;;) {
        uint64_t p = __atomic_load_n(r->producer, __ATOMIC_ACQUIRE);
        if (p < r->consumer || p - r->consumer > r->size) return RING_IMPOSSIBLE;
        if (p >= target) return 0;
        if (why == 2) return boundary && p == r->consumer ? RING_ENDED : RING_CUT;
        if (why) return why;  /* RING_STOPPED, RING_WRITER_GONE */
        busy_poll_word(r->producer, (int64_t)target, r->stop, r->stop_value, r->closed, r->closed_value, spin_ns, counts);
        spin_ns = 0;
        /* 0: reached (looked at again above: a hostile writer may have moved it back), else why it ended */
        why = ring_wait(r->producer, (int64_t)target, r->want, target, r->stop, r->stop_value, r->closed,
                        r->closed_value, r->pid, 0);
    }
}

/* Copy `len` bytes of the stream out of the ring into `out`, as the writer publishes them, in pieces of
 * at most half the ring, publishing the consumer position behind each (waking a writer waiting for
 * room). 0 or a RING_ code. GIL not held. */
static int ring_reader_take(struct ring_reader *r, uint8_t *out, uint64_t len, int boundary, uint64_t spin_ns,
                            uint64_t *counts) {
    uint64_t piece_max = r->size / 2 ? r->size / 2 : 1;
    for (uint64_t done = 0; done < len;) {
        uint64_t piece = len - done < piece_max ? len - done : piece_max;
        int rc = ring_reader_wait(r, piece, boundary && done == 0, done == 0 ? spin_ns : 0, counts);
        if (rc) return rc;
        ring_move(1, out + done, (uint8_t *)r->data, r->size, r->consumer % r->size, piece);
        r->consumer += piece;
        ring_publish_word(r->consumer_word, r->consumer, r->peer_want);
        done += piece;
    }
    return 0;
}

/* ring_frame_head(ring_data, ring_size, consumer, producer_address, consumer_address, stop_address, stop_value,
 *                 closed_address, closed_value, pid, want_address, peer_want_address,
 *                 version, max_runs, max_payload, max_message, max_offset, max_ordered[, spin_ns, counts])
 *     -> (rc, consumer, head)
 * recv_frame_head over the shm ring (kvxfer/transport/shm.py's layout): wait for the next frame's header
 * (busy polling spin_ns first when it is not there yet), copy it out of the ring, check it, copy a WRITE
 * frame's run table, a DONE body or an ORDERED body of at most max_ordered bytes out too, checking them
 * after the copy (the writer can still change the ring), and publish the consumer position behind what
 * was copied. rc 0: `head` is recv_frame_head's tuple (a body left in the ring for status 1 and -1);
 * else head is None and rc says why the wait ended (1 stopped, 2 the writer closed inside a frame, 3 its
 * process `pid` is gone, 5 it closed at the frame boundary, 6 the producer position is impossible).
 * `consumer` is the consumer position now published (bytes copied out stay consumed whatever rc). The
 * twin of shm.py's Python reader (_wait, parse_header, parse_runs, parse_done): tests/test_shm_frames.py
 * holds them equal on random and hostile frames written into a small ring. GIL released while waiting
 * and copying; the caller keeps the mapping alive. */
static PyObject *ring_frame_head(PyObject *self, PyObject *args) {
    unsigned long long ring_data, ring_size, consumer, producer_address, consumer_address, stop_address, stop_value,
        closed_address, closed_value, want_address, peer_want_address, max_payload, max_message, max_offset,
        max_ordered, spin_ns = 0, counts_address = 0;
    long pid;
    unsigned int version, max_runs;
    if (!PyArg_ParseTuple(args, "KKKKKKKKKlKKIIKKKK|KK", &ring_data, &ring_size, &consumer, &producer_address,
                          &consumer_address, &stop_address, &stop_value, &closed_address, &closed_value, &pid,
                          &want_address, &peer_want_address, &version, &max_runs, &max_payload, &max_message,
                          &max_offset, &max_ordered, &spin_ns, &counts_address))
        return NULL;
    if (ring_data == 0 || ring_size == 0 || ring_size > (1ull << 62) || consumer > (1ull << 62) ||
        producer_address == 0 || consumer_address == 0 || stop_address == 0 || closed_address == 0 ||
        (producer_address | consumer_address | stop_address | closed_address | want_address | peer_want_address |
         counts_address) % 8) {
        PyErr_SetString(PyExc_ValueError, "ring_frame_head needs the ring, a positive size and aligned ring words");
        return NULL;
    }
    struct ring_reader r = {(const uint8_t *)(uintptr_t)ring_data, ring_size, consumer,
                            (const uint64_t *)(uintptr_t)producer_address, (const uint64_t *)(uintptr_t)stop_address,
                            (const uint64_t *)(uintptr_t)closed_address, (uint64_t *)(uintptr_t)consumer_address,
                            (uint64_t *)(uintptr_t)want_address, (uint64_t *)(uintptr_t)peer_want_address,
                            stop_value, closed_value, pid};
    uint64_t *counts = (uint64_t *)(uintptr_t)counts_address;
    struct frame_head fh;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ring_reader_take(&r, fh.h, sizeof(fh.h), 1, spin_ns, counts);
    Py_END_ALLOW_THREADS
    if (rc) return Py_BuildValue("(iKO)", rc, (unsigned long long)r.consumer, Py_None);
    check_frame_head(&fh, version, max_runs, max_payload, max_message, max_ordered);
    PyObject *body = NULL;
    if (frame_body_wanted(&fh)) {
        body = PyBytes_FromStringAndSize(NULL, fh.body_len);
        if (body == NULL) return NULL;
        uint8_t *out = (uint8_t *)PyBytes_AS_STRING(body);
        Py_BEGIN_ALLOW_THREADS
        rc = ring_reader_take(&r, out, fh.body_len, 0, 0, NULL);
        Py_END_ALLOW_THREADS
        if (rc) {
            Py_DECREF(body);
            return Py_BuildValue("(iKO)", rc, (unsigned long long)r.consumer, Py_None);
        }
    }
    PyObject *head = frame_head_result(&fh, body, max_payload, max_offset);
    if (head == NULL) return NULL;
    return Py_BuildValue("(iKN)", 0, (unsigned long long)r.consumer, head);
}

static PyMethodDef methods[] = {
    {"checksum_items", checksum_items, METH_VARARGS,
     "checksum_items(algo, initial, addresses, lengths, item_lens) -> uint32 item checksums"},
    {"copy_runs", copy_runs, METH_VARARGS, "copy_runs(dst_addresses, src_addresses, lengths): memcpy every run"},
    {"copy_runs_summed", copy_runs_summed, METH_VARARGS,
     "copy_runs_summed(dst_addresses, src_addresses, lengths, item_lens, algo, initial, chunk) -> uint32 item checksums"},
    {"ring_copy", ring_copy, METH_VARARGS,
     "ring_copy(addresses, lengths, item_lens, algo, initial, chunk, ring_data, ring_size, position, ring_is_src, "
     "wait_address, publish_address, stop_address, stop_value, closed_address, closed_value, pid[, want_address, "
     "peer_want_address]) -> (rc, sums or None)"},
    {"ring_run_table", ring_run_table, METH_VARARGS,
     "ring_run_table(runs, bases, item_lens, num_pages, algo, initial, chunk, ring..., words...) -> (rc, sums or None): "
     "ring_copy from a WRITE frame's run table"},
    {"ring_frame_head", ring_frame_head, METH_VARARGS,
     "ring_frame_head(ring_data, ring_size, consumer, words..., limits...) -> (rc, consumer, head): recv_frame_head "
     "over the shm ring"},
    {"ring_wait", py_ring_wait, METH_VARARGS,
     "ring_wait(address, target, want_address, stop_address, stop_value, closed_address, closed_value, pid, timeout"
     "[, spin_ns, counts]) -> rc: wait (futex, GIL released) until the word reaches target, busy polling first"},
    {"ring_publish", py_ring_publish, METH_VARARGS,
     "ring_publish(address, value, want_address): store-release a position, waking the other side if it waits"},
    {"ring_wake", py_ring_wake, METH_VARARGS, "ring_wake(address): wake every side sleeping on a position word"},
    {"ring_load", ring_load, METH_VARARGS, "ring_load(address) -> int: load-acquire of a 64-bit word"},
    {"ring_store", ring_store, METH_VARARGS, "ring_store(address, value): store-release of a 64-bit word"},
    {"checksum_runs", checksum_runs, METH_VARARGS, "checksum_runs(algo, value, addresses, lengths) -> int"},
    {"combine_items", combine_items, METH_VARARGS,
     "combine_items(algo, initial, values, lengths) -> int: the checksum of concatenated pieces"},
    {"load_zlib_ng", load_zlib_ng, METH_VARARGS, "load_zlib_ng(path) -> bool: use zlib-ng's C checksums"},
    {"recv_runs", recv_runs, METH_VARARGS, "recv_runs(fd, addresses, lengths): fill runs from a socket"},
    {"check_run_table", check_run_table, METH_VARARGS,
     "check_run_table(runs, payload_len, max_payload, max_offset) -> bool: a WRITE run table within the limits"},
    {"recv_frame_head", recv_frame_head, METH_VARARGS,
     "recv_frame_head(fd, version, max_runs, max_payload, max_message, max_offset[, max_ordered[, spin_ns, counts]]) "
     "-> (status, kind, "
     "slot, generation, count, body_len, payload_len, header, body)"},
    {"recv_run_table", recv_run_table, METH_VARARGS,
     "recv_run_table(fd, runs, bases, item_lens, num_pages, algo, initial, chunk) -> bytes or None: land a WRITE frame's "
     "payload from its run table (item checksums with algo >= 0)"},
    {"recv_runs_summed", recv_runs_summed, METH_VARARGS,
     "recv_runs_summed(fd, addresses, lengths, item_lens, algo, initial, chunk) -> uint32 item checksums"},
    {"send_runs", send_runs, METH_VARARGS, "send_runs(fd, prefix, addresses, lengths): gather-send runs"},
    {"send_runs_nowait", send_runs_nowait, METH_VARARGS,
     "send_runs_nowait(fd, prefix, addresses, lengths) -> int: gather-send without waiting; bytes sent"},
    {"send_summed_done", send_summed_done, METH_VARARGS,
     "send_summed_done(fd, addresses, lengths, item_lens, algo, initial, done, sum_at) -> (done sent, checksum)"},
    {"send_frames", send_frames, METH_VARARGS,
     "send_frames(fd, prefixes, prefix_ends, run_ends, addresses, lengths, item_lens, algo, initial, chunk) -> "
     "uint32 item checksums or None: several frames, each its prefix then its runs"},
    {"send_runs_summed", send_runs_summed, METH_VARARGS,
     "send_runs_summed(fd, prefix, addresses, lengths, item_lens, algo, initial, chunk) -> uint32 item checksums"},
    {"guard_accept", guard_accept, METH_VARARGS,
     "guard_accept(runs, item_lens, num_pages, state, stamps, owner_gen, writable_mask) -> int64 page counts or None"},
    {"guard_record", guard_record, METH_VARARGS,
     "guard_record(runs, item_lens, num_pages, covered, summed, item_sum, sums, state, stamps, gen, reserved, "
     "written) -> (duplicate_items, bytes)"},
    {"guard_landed", guard_landed, METH_VARARGS,
     "guard_landed(pages, item_lens, num_pages, covered, summed, item_sum, algo, initial) -> (uncovered, checksum)"},
    {"random_take", random_take, METH_VARARGS,
     "random_take(items, n, out, seed): len(out) distinct entries of items[:n] at random into out, the rest "
     "kept in items[:n - len(out)]"},
    {"ledger_move", ledger_move, METH_VARARGS,
     "ledger_move(pages, state, stamps, gen, allowed_mask, new_state) -> bool: check and move owned pages"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "kvxfer._native",
    .m_doc = "kvxfer's native data path (see native/).",
    .m_size = -1,
    .m_methods = methods,
};

/* SEND_GROUP and RECV_GROUP are the module's constants too: the tcp transport's checked path sends and
 * lands in the same groups (kvxfer/transport/tcp.py). */
PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "SEND_GROUP", SEND_GROUP) < 0 ||
        PyModule_AddIntConstant(m, "RECV_GROUP", RECV_GROUP) < 0 ||
        PyModule_AddIntConstant(m, "DONE_BODY_MAX", DONE_BODY_MAX) < 0 ||
        PyModule_AddIntConstant(m, "DONE_AUX_MAX", DONE_AUX_MAX) < 0 ||
        PyModule_AddIntConstant(m, "BUSY_POLLERS", BUSY_POLLERS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
