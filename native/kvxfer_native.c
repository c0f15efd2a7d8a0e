/*
 * kvxfer._native: the tcp transport's byte-moving loops, in C, with the GIL released.
 *
 * recv_runs(fd, addresses, lengths): fill every (address, length) run from a blocking socket with
 *     readv(2), in order, until all bytes arrived. Raises ConnectionError on EOF, OSError on error.
 * send_runs(fd, prefix, addresses, lengths): send `prefix` then every run with sendmsg(2)
 *     (MSG_NOSIGNAL), handling partial sends.
 *
 * `addresses` and `lengths` are native-endian uint64 arrays (numpy .tobytes() of uint64). The
 * caller guarantees every run lies inside memory it registered: the write guard has checked the
 * destination runs against the page ledger before recv_runs is called, and the source runs come
 * from the sender's own layout. Nothing here allocates or copies payload bytes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>

#define IOV_BATCH 512

static int parse_runs(Py_buffer *addrs, Py_buffer *lens, size_t *count) {
    if (addrs->len != lens->len || addrs->len % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "addresses and lengths must be uint64 arrays of equal size");
        return -1;
    }
    *count = (size_t)addrs->len / 8;
    return 0;
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
    const uint64_t *a = (const uint64_t *)addrs.buf;
    const uint64_t *l = (const uint64_t *)lens.buf;
    int err = 0, eof = 0;
    Py_BEGIN_ALLOW_THREADS
    struct iovec iov[IOV_BATCH];
    size_t i = 0, off = 0;
    while (i < n) {
        if (l[i] == off) { i++; off = 0; continue; }
        int k = 0;
        size_t j = i, o = off;
        while (j < n && k < IOV_BATCH) {
            iov[k].iov_base = (char *)(uintptr_t)a[j] + o;
            iov[k].iov_len = (size_t)(l[j] - o);
            o = 0;
            k++;
            j++;
        }
        ssize_t r = readv(fd, iov, k);
        if (r < 0) {
            if (errno == EINTR) continue;
            err = errno;
            break;
        }
        if (r == 0) { eof = 1; break; }
        size_t got = (size_t)r;
        while (got > 0) {
            size_t left = (size_t)l[i] - off;
            if (got >= left) { got -= left; i++; off = 0; }
            else { off += got; got = 0; }
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&addrs);
    PyBuffer_Release(&lens);
    if (err) { errno = err; return PyErr_SetFromErrno(PyExc_OSError); }
    if (eof) { PyErr_SetString(PyExc_ConnectionError, "peer closed the connection"); return NULL; }
    Py_RETURN_NONE;
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
    const uint64_t *a = (const uint64_t *)addrs.buf;
    const uint64_t *l = (const uint64_t *)lens.buf;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    struct iovec iov[IOV_BATCH];
    /* run index -1 is the prefix */
    long i = -1;
    size_t off = 0;
    while (i < (long)n) {
        int k = 0;
        long j = i;
        size_t o = off;
        while (j < (long)n && k < IOV_BATCH) {
            char *base = j < 0 ? (char *)prefix.buf : (char *)(uintptr_t)a[j];
            size_t len = j < 0 ? (size_t)prefix.len : (size_t)l[j];
            if (len > o) {
                iov[k].iov_base = base + o;
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
            err = errno;
            break;
        }
        size_t sent = (size_t)r;
        while (sent > 0 && i < (long)n) {
            size_t len = i < 0 ? (size_t)prefix.len : (size_t)l[i];
            size_t left = len - off;
            if (sent >= left) { sent -= left; i++; off = 0; }
            else { off += sent; sent = 0; }
        }
        /* skip empty runs */
        while (i < (long)n && (i < 0 ? (size_t)prefix.len : (size_t)l[i]) == off) { i++; off = 0; }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&prefix);
    PyBuffer_Release(&addrs);
    PyBuffer_Release(&lens);
    if (err) { errno = err; return PyErr_SetFromErrno(PyExc_OSError); }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"recv_runs", recv_runs, METH_VARARGS, "recv_runs(fd, addresses, lengths): fill runs from a socket"},
    {"send_runs", send_runs, METH_VARARGS, "send_runs(fd, prefix, addresses, lengths): gather-send runs"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvxfer._native", "kvxfer's native data path (see native/).", -1, methods,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
