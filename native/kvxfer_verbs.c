/*
 * kvxfer._verbs: the verbs transport's per-work-request loops in C.
 *
 * pyverbs creates and owns every verbs object (context, PD, MRs, CQs, QPs) and their lifetimes;
 * this module only posts chains of work requests and polls completion queues on objects pyverbs
 * made, so that no Python runs per page:
 *
 *   qp_handle(qp, qpn) / cq_handle(cq, context) -> int   raw ibv_qp / ibv_cq pointer of a pyverbs
 *        object, read from its Cython layout and validated (qp_num / context must match), or
 *        ValueError: the caller then falls back to pure pyverbs.
 *   post_writes(qp, wr_id, local, lens, lkeys, remote, rkeys, signal_every, imm) -> None
 *        one chained ibv_post_send of RDMA WRITEs; every `signal_every`-th and the last WR are
 *        signalled; if imm >= 0 the last WR is RDMA_WRITE_WITH_IMM carrying imm (host order).
 *   post_recvs(qp, wr_id, count, addr, length, lkey) -> None     receive WRs for immediates.
 *   poll(cq, max) -> bytes     packed <QIIIIII> records: wr_id, status, opcode, byte_len, imm
 *        (host order), wc_flags, qp_num.
 *
 * Memory windows (type 2B, issue 17; the receiver binds one per run of a request's pages on the
 * queue pair of the writer's connection and invalidates it before the pages can be reused):
 *
 *   mw_handle(mw, rkey, context) -> int     raw ibv_mw pointer of a pyverbs MW (validated: context,
 *        rkey and type 2 must match), or ValueError.
 *   mr_handle(bind_info, lkey, context) -> int     the ibv_mr pointer a pyverbs MWBindInfo holds
 *        (validated: context and lkey must match), or ValueError.
 *   post_binds(qp, wr_id, mws, rkeys, mrs, addrs, lens, access) -> None     one chained
 *        ibv_post_send of IBV_WR_BIND_MW, only the last signalled; on success each window's
 *        ibv_mw.rkey becomes its new rkey (the next bind and the invalidation name the current key).
 *   post_invalidates(qp, wr_id, rkeys) -> None     one chain of IBV_WR_LOCAL_INV, only the last
 *        signalled.
 *
 * Arrays are native-endian numpy .tobytes() (uint64 addresses/lengths, uint32 keys). The caller
 * keeps the pyverbs objects alive while it uses their handles and never posts more WRs than the
 * queue pair has room for.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* pyverbs' Cython layout (rdma-core pyverbs/base.pxd, qp.pxd, cq.pxd): PyObject_HEAD, then
 * PyverbsObject's __weakref__ and logger, then PyverbsCM's vtable pointer, then the class's first
 * field, which is the C object pointer for both QP and CQ. */
#define PYVERBS_PTR_OFFSET (sizeof(PyObject) + 3 * sizeof(void *))

/* The pointer-sized field `index` after PyverbsCM's head (0: the verbs object of QP, CQ, MWBindInfo;
 * 1: MW's, after its `object pd`), or NULL when the object is too small to have it. */
static void *pyverbs_field(PyObject *obj, size_t index) {
    size_t offset = PYVERBS_PTR_OFFSET + index * sizeof(void *);
    if ((size_t)Py_TYPE(obj)->tp_basicsize < offset + sizeof(void *)) return NULL;
    return *(void **)((char *)obj + offset);
}

static void *pyverbs_ptr(PyObject *obj) { return pyverbs_field(obj, 0); }

static PyObject *qp_handle(PyObject *self, PyObject *args) {
    PyObject *qp_obj;
    unsigned long qpn;
    if (!PyArg_ParseTuple(args, "Ok", &qp_obj, &qpn)) return NULL;
    struct ibv_qp *qp = (struct ibv_qp *)pyverbs_ptr(qp_obj);
    if (qp == NULL || qp->qp_num != (uint32_t)qpn || qp->context == NULL) {
        PyErr_SetString(PyExc_ValueError, "not a pyverbs QP with the expected layout");
        return NULL;
    }
    return PyLong_FromVoidPtr(qp);
}

static PyObject *cq_handle(PyObject *self, PyObject *args) {
    PyObject *cq_obj;
    unsigned long long context;
    if (!PyArg_ParseTuple(args, "OK", &cq_obj, &context)) return NULL;
    struct ibv_cq *cq = (struct ibv_cq *)pyverbs_ptr(cq_obj);
    if (cq == NULL || (uintptr_t)cq->context != (uintptr_t)context || cq->cqe <= 0) {
        PyErr_SetString(PyExc_ValueError, "not a pyverbs CQ with the expected layout");
        return NULL;
    }
    return PyLong_FromVoidPtr(cq);
}

static PyObject *post_writes(PyObject *self, PyObject *args) {
    unsigned long long qp_addr, wr_id;
    Py_buffer local, lens, lkeys, remote, rkeys;
    int signal_every;
    long long imm;
    if (!PyArg_ParseTuple(args, "KKy*y*y*y*y*iL", &qp_addr, &wr_id, &local, &lens, &lkeys, &remote, &rkeys,
                          &signal_every, &imm))
        return NULL;
    PyObject *result = NULL;
    size_t n = (size_t)local.len / 8;
    if (lens.len != local.len || remote.len != local.len || lkeys.len * 2 != local.len ||
        rkeys.len * 2 != local.len || n == 0 || signal_every < 1) {
        PyErr_SetString(PyExc_ValueError, "post_writes: inconsistent arrays");
        goto done;
    }
    struct ibv_send_wr *wrs = calloc(n, sizeof *wrs);
    struct ibv_sge *sges = calloc(n, sizeof *sges);
    if (wrs == NULL || sges == NULL) {
        free(wrs);
        free(sges);
        PyErr_NoMemory();
        goto done;
    }
    const uint64_t *la = local.buf, *ln = lens.buf, *ra = remote.buf;
    const uint32_t *lk = lkeys.buf, *rk = rkeys.buf;
    for (size_t i = 0; i < n; i++) {
        sges[i].addr = la[i];
        sges[i].length = (uint32_t)ln[i];
        sges[i].lkey = lk[i];
        wrs[i].wr_id = wr_id + i;
        wrs[i].sg_list = &sges[i];
        wrs[i].num_sge = 1;
        wrs[i].opcode = IBV_WR_RDMA_WRITE;
        wrs[i].wr.rdma.remote_addr = ra[i];
        wrs[i].wr.rdma.rkey = rk[i];
        wrs[i].next = i + 1 < n ? &wrs[i + 1] : NULL;
        if ((i + 1) % (size_t)signal_every == 0 || i + 1 == n) wrs[i].send_flags = IBV_SEND_SIGNALED;
    }
    if (imm >= 0) {
        wrs[n - 1].opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
        wrs[n - 1].imm_data = htonl((uint32_t)imm);
    }
    struct ibv_send_wr *bad = NULL;
    int rc = ibv_post_send((struct ibv_qp *)(uintptr_t)qp_addr, wrs, &bad);
    if (rc) {
        long index = bad ? (long)(bad - wrs) : -1;
        PyErr_Format(PyExc_OSError, "ibv_post_send failed with %d (%s) at work request %ld of %zu", rc,
                     strerror(rc), index, n);
    } else {
        result = Py_None;
        Py_INCREF(result);
    }
    free(wrs);
    free(sges);
done:
    PyBuffer_Release(&local);
    PyBuffer_Release(&lens);
    PyBuffer_Release(&lkeys);
    PyBuffer_Release(&remote);
    PyBuffer_Release(&rkeys);
    return result;
}

static PyObject *post_recvs(PyObject *self, PyObject *args) {
    unsigned long long qp_addr, wr_id, addr;
    unsigned int count, length, lkey;
    if (!PyArg_ParseTuple(args, "KKIKII", &qp_addr, &wr_id, &count, &addr, &length, &lkey)) return NULL;
    if (count == 0) Py_RETURN_NONE;
    struct ibv_recv_wr *wrs = calloc(count, sizeof *wrs);
    struct ibv_sge *sges = calloc(count, sizeof *sges);
    if (wrs == NULL || sges == NULL) {
        free(wrs);
        free(sges);
        return PyErr_NoMemory();
    }
    for (unsigned int i = 0; i < count; i++) {
        sges[i].addr = addr;
        sges[i].length = length;
        sges[i].lkey = lkey;
        wrs[i].wr_id = wr_id + i;
        wrs[i].sg_list = &sges[i];
        wrs[i].num_sge = 1;
        wrs[i].next = i + 1 < count ? &wrs[i + 1] : NULL;
    }
    struct ibv_recv_wr *bad = NULL;
    int rc = ibv_post_recv((struct ibv_qp *)(uintptr_t)qp_addr, wrs, &bad);
    free(wrs);
    free(sges);
    if (rc) return PyErr_Format(PyExc_OSError, "ibv_post_recv failed with %d (%s)", rc, strerror(rc));
    Py_RETURN_NONE;
}

#pragma pack(push, 1)
struct record {
    uint64_t wr_id;
    uint32_t status, opcode, byte_len, imm, wc_flags, qp_num;
};
#pragma pack(pop)

static PyObject *poll(PyObject *self, PyObject *args) {
    unsigned long long cq_addr;
    int max;
    if (!PyArg_ParseTuple(args, "Ki", &cq_addr, &max)) return NULL;
    if (max <= 0 || max > 4096) {
        PyErr_SetString(PyExc_ValueError, "poll: max must be in 1..4096");
        return NULL;
    }
    struct ibv_wc wc[64];
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)max * sizeof(struct record));
    if (out == NULL) return NULL;
    struct record *rec = (struct record *)PyBytes_AS_STRING(out);
    int total = 0;
    while (total < max) {
        int want = max - total < 64 ? max - total : 64;
        int got = ibv_poll_cq((struct ibv_cq *)(uintptr_t)cq_addr, want, wc);
        if (got < 0) {
            Py_DECREF(out);
            return PyErr_Format(PyExc_OSError, "ibv_poll_cq failed with %d", got);
        }
        for (int i = 0; i < got; i++, total++) {
            rec[total].wr_id = wc[i].wr_id;
            rec[total].status = wc[i].status;
            rec[total].opcode = wc[i].opcode;
            rec[total].byte_len = wc[i].byte_len;
            rec[total].imm = (wc[i].wc_flags & IBV_WC_WITH_IMM) ? ntohl(wc[i].imm_data) : 0;
            rec[total].wc_flags = wc[i].wc_flags;
            rec[total].qp_num = wc[i].qp_num;
        }
        if (got < want) break;
    }
    if (_PyBytes_Resize(&out, (Py_ssize_t)total * sizeof(struct record)) < 0) return NULL;
    return out;
}

/* Memory windows ----------------------------------------------------------------------------- */

/* pyverbs' MW: PyverbsCM's head, then `object pd`, then `ibv_mw *mw` (rdma-core pyverbs/mr.pxd). */
static PyObject *mw_handle(PyObject *self, PyObject *args) {
    PyObject *obj;
    unsigned long rkey;
    unsigned long long context;
    if (!PyArg_ParseTuple(args, "OkK", &obj, &rkey, &context)) return NULL;
    struct ibv_mw *mw = (struct ibv_mw *)pyverbs_field(obj, 1);
    if (mw == NULL || (uintptr_t)mw->context != (uintptr_t)context || mw->rkey != (uint32_t)rkey ||
        mw->type != IBV_MW_TYPE_2) {
        PyErr_SetString(PyExc_ValueError, "not a pyverbs type-2 MW with the expected layout");
        return NULL;
    }
    return PyLong_FromVoidPtr(mw);
}

/* pyverbs' MWBindInfo: PyverbsCM's head, then the ibv_mw_bind_info itself, whose first field is the
 * ibv_mr pointer. */
static PyObject *mr_handle(PyObject *self, PyObject *args) {
    PyObject *obj;
    unsigned long lkey;
    unsigned long long context;
    if (!PyArg_ParseTuple(args, "OkK", &obj, &lkey, &context)) return NULL;
    struct ibv_mr *mr = (struct ibv_mr *)pyverbs_ptr(obj);
    if (mr == NULL || (uintptr_t)mr->context != (uintptr_t)context || mr->lkey != (uint32_t)lkey) {
        PyErr_SetString(PyExc_ValueError, "not a pyverbs MWBindInfo with the expected layout");
        return NULL;
    }
    return PyLong_FromVoidPtr(mr);
}

static PyObject *post_binds(PyObject *self, PyObject *args) {
    unsigned long long qp_addr, wr_id;
    Py_buffer mws, rkeys, mrs, addrs, lens;
    int access;
    if (!PyArg_ParseTuple(args, "KKy*y*y*y*y*i", &qp_addr, &wr_id, &mws, &rkeys, &mrs, &addrs, &lens, &access))
        return NULL;
    PyObject *result = NULL;
    size_t n = (size_t)mws.len / 8;
    struct ibv_send_wr *wrs = NULL;
    if (rkeys.len * 2 != mws.len || mrs.len != mws.len || addrs.len != mws.len || lens.len != mws.len || n == 0) {
        PyErr_SetString(PyExc_ValueError, "post_binds: inconsistent arrays");
        goto done;
    }
    wrs = calloc(n, sizeof *wrs);
    if (wrs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    struct ibv_mw *const *mw = mws.buf;
    struct ibv_mr *const *mr = mrs.buf;
    const uint32_t *rk = rkeys.buf;
    const uint64_t *ad = addrs.buf, *ln = lens.buf;
    for (size_t i = 0; i < n; i++) {
        wrs[i].wr_id = wr_id + i;
        wrs[i].opcode = IBV_WR_BIND_MW;
        wrs[i].bind_mw.mw = mw[i];
        wrs[i].bind_mw.rkey = rk[i];
        wrs[i].bind_mw.bind_info.mr = mr[i];
        wrs[i].bind_mw.bind_info.addr = ad[i];
        wrs[i].bind_mw.bind_info.length = ln[i];
        wrs[i].bind_mw.bind_info.mw_access_flags = (unsigned int)access;
        wrs[i].next = i + 1 < n ? &wrs[i + 1] : NULL;
    }
    wrs[n - 1].send_flags = IBV_SEND_SIGNALED;
    struct ibv_send_wr *bad = NULL;
    int rc = ibv_post_send((struct ibv_qp *)(uintptr_t)qp_addr, wrs, &bad);
    /* the provider builds each WQE from the window's current key: the next bind or invalidation of
     * a window posted here names its new key (WRs before a bad one were posted) */
    size_t posted = rc ? (bad ? (size_t)(bad - wrs) : 0) : n;
    for (size_t i = 0; i < posted; i++) mw[i]->rkey = rk[i];
    if (rc) {
        PyErr_Format(PyExc_OSError, "ibv_post_send (bind) failed with %d (%s) at work request %zu of %zu", rc,
                     strerror(rc), posted, n);
    } else {
        result = Py_None;
        Py_INCREF(result);
    }
done:
    free(wrs);
    PyBuffer_Release(&mws);
    PyBuffer_Release(&rkeys);
    PyBuffer_Release(&mrs);
    PyBuffer_Release(&addrs);
    PyBuffer_Release(&lens);
    return result;
}

static PyObject *post_invalidates(PyObject *self, PyObject *args) {
    unsigned long long qp_addr, wr_id;
    Py_buffer rkeys;
    if (!PyArg_ParseTuple(args, "KKy*", &qp_addr, &wr_id, &rkeys)) return NULL;
    PyObject *result = NULL;
    size_t n = (size_t)rkeys.len / 4;
    struct ibv_send_wr *wrs = NULL;
    if (n == 0 || rkeys.len % 4) {
        PyErr_SetString(PyExc_ValueError, "post_invalidates: no keys");
        goto done;
    }
    wrs = calloc(n, sizeof *wrs);
    if (wrs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const uint32_t *rk = rkeys.buf;
    for (size_t i = 0; i < n; i++) {
        wrs[i].wr_id = wr_id + i;
        wrs[i].opcode = IBV_WR_LOCAL_INV;
        wrs[i].invalidate_rkey = rk[i];
        wrs[i].next = i + 1 < n ? &wrs[i + 1] : NULL;
    }
    wrs[n - 1].send_flags = IBV_SEND_SIGNALED;
    struct ibv_send_wr *bad = NULL;
    int rc = ibv_post_send((struct ibv_qp *)(uintptr_t)qp_addr, wrs, &bad);
    if (rc) {
        long index = bad ? (long)(bad - wrs) : -1;
        PyErr_Format(PyExc_OSError, "ibv_post_send (invalidate) failed with %d (%s) at work request %ld of %zu",
                     rc, strerror(rc), index, n);
    } else {
        result = Py_None;
        Py_INCREF(result);
    }
done:
    free(wrs);
    PyBuffer_Release(&rkeys);
    return result;
}

static PyMethodDef methods[] = {
    {"qp_handle", qp_handle, METH_VARARGS, "raw ibv_qp pointer of a pyverbs QP (validated)"},
    {"cq_handle", cq_handle, METH_VARARGS, "raw ibv_cq pointer of a pyverbs CQ (validated)"},
    {"post_writes", post_writes, METH_VARARGS, "post a chain of RDMA WRITEs (last one optionally with IMM)"},
    {"post_recvs", post_recvs, METH_VARARGS, "post receive WRs"},
    {"poll", poll, METH_VARARGS, "poll a CQ into packed records"},
    {"mw_handle", mw_handle, METH_VARARGS, "raw ibv_mw pointer of a pyverbs type-2 MW (validated)"},
    {"mr_handle", mr_handle, METH_VARARGS, "raw ibv_mr pointer held by a pyverbs MWBindInfo (validated)"},
    {"post_binds", post_binds, METH_VARARGS, "post a chain of type-2 memory window binds (last signalled)"},
    {"post_invalidates", post_invalidates, METH_VARARGS, "post a chain of LOCAL_INV (last signalled)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "kvxfer._verbs",
    .m_doc = "kvxfer's native verbs posting and polling (see native/).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__verbs(void) { return PyModule_Create(&module); }
