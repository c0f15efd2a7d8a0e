/* kvxfer._native's write-guard rules (native/kvxfer_guard.c) and the checksum combination they share
 * with the byte-moving loops (native/kvxfer_native.c). */
#ifndef KVXFER_GUARD_H
#define KVXFER_GUARD_H

#include <Python.h>
#include <stdint.h>

PyObject *guard_accept(PyObject *self, PyObject *args);
PyObject *guard_record(PyObject *self, PyObject *args);
PyObject *guard_landed(PyObject *self, PyObject *args);
PyObject *ledger_move(PyObject *self, PyObject *args);
PyObject *random_take(PyObject *self, PyObject *args);

/* Combining piece checksums (algo 0 = Adler-32, 1 = CRC32): prepare once per piece length (-1 with an
 * exception set when zlib-ng's functions are not loaded), then step per piece. */
int native_combine_prepare(int algo, uint64_t len, uint32_t *op);
uint32_t native_combine_step(int algo, uint32_t acc, uint32_t value, uint64_t len, uint32_t op);

#endif
