/* kvtier.tiers._rawread: the read path for ``raw`` values, in C (and the copy +
checksum of the write path: copy_sum_many, used by the remote tier's puts).

What it owns: for a batch of LMDB values (zero-copy views into the map), check
each one's header exactly as kvtier.tiers.codec's fast path does (magic,
format version, codec raw, no flags, key, namespace digest, layout hash,
lengths, header checksum), copy its payload into the caller's buffer and check
the payload's XXH3-64 -- all with the GIL released once per batch, so a read
thread spends no interpreter time per block and two threads copy in parallel.

What it must not do: decide anything the Python codec would not. It answers
only "shown OK here" (True) or "not shown OK here" (False); on False the caller
runs the general Python decoder, which tells why (absent, corrupt, foreign,
another codec) and counts it. It never writes outside a buffer whose length
it checked, and never reads past a value's length. It holds no state but the
address of XXH3_64bits.

XXH3-64 is not implemented here: it is looked up at import in the xxhash
package's own extension module (which exports the xxHash library's public
XXH3_64bits, and its CPU-dispatching XXH3_64bits_dispatch, preferred), and
checked against xxhash.xxh3_64_intdigest on a test buffer.
Where either fails, importing this module fails and kvtier stays on the
pure-Python path.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

typedef uint64_t (*xxh3_fn)(const void *, size_t);
static xxh3_fn xxh3_64 = NULL;

/* Header layout: struct "<4sBBH16s16s8s16sIIIIQ" then "<Q" (kvtier.tiers.codec). */
enum {
    OFF_MAGIC = 0,
    OFF_VERSION = 4,
    OFF_CODEC = 5,
    OFF_FLAGS = 6,
    OFF_KEY = 8,
    OFF_NS = 24,
    OFF_LAYOUT = 40,
    OFF_RAW_LEN = 68,
    OFF_PAYLOAD_LEN = 72,
    OFF_PLANE0_LEN = 76,
    OFF_RAW_SUM = 80,
    FIELDS_BYTES = 88,
    HEADER_BYTES = 96,
    KEY_LEN = 16,
    NS_LEN = 16,
    LAYOUT_LEN = 8,
};

static uint32_t le32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t le64(const unsigned char *p) {
    return (uint64_t)le32(p) | (uint64_t)le32(p + 4) << 32;
}

typedef struct {
    Py_buffer value;
    Py_buffer out;
    unsigned char key[16]; /* copied: nothing borrowed is read without the GIL */
    int have_value;
    int have_out;
    int ok;
} item_t;

/* One block, GIL released: 1 only when every check of codec._decode_raw_fast holds. */
static int read_one(const item_t *it, const unsigned char *magic, unsigned version, const unsigned char *ns,
                    const unsigned char *layout) {
    const unsigned char *v = (const unsigned char *)it->value.buf;
    Py_ssize_t vlen = it->value.len;
    if (vlen < HEADER_BYTES) return 0;
    if (memcmp(v + OFF_MAGIC, magic, 4) != 0 || v[OFF_VERSION] != version || v[OFF_CODEC] != 0) return 0;
    if (v[OFF_FLAGS] != 0 || v[OFF_FLAGS + 1] != 0) return 0;
    if (memcmp(v + OFF_KEY, it->key, KEY_LEN) != 0 || memcmp(v + OFF_NS, ns, NS_LEN) != 0 ||
        memcmp(v + OFF_LAYOUT, layout, LAYOUT_LEN) != 0)
        return 0;
    uint32_t raw_len = le32(v + OFF_RAW_LEN), payload_len = le32(v + OFF_PAYLOAD_LEN);
    if (le32(v + OFF_PLANE0_LEN) != 0 || payload_len != raw_len || (Py_ssize_t)payload_len != vlen - HEADER_BYTES)
        return 0;
    if (it->out.len != (Py_ssize_t)raw_len) return 0;
    if (xxh3_64(v, FIELDS_BYTES) != le64(v + FIELDS_BYTES)) return 0;
    memmove(it->out.buf, v + HEADER_BYTES, raw_len); /* memmove: a caller's buffer may overlap the value */
    return xxh3_64(it->out.buf, raw_len) == le64(v + OFF_RAW_SUM);
}

PyDoc_STRVAR(read_raw_many_doc,
"read_raw_many(values, keys, outs, magic, version, namespace_digest, layout_hash) -> list[bool]\n\n"
"For each i: True when values[i] is a raw value written for keys[i] (16 bytes)\n"
"in this namespace and layout, both its checksums verify, and its payload was\n"
"copied into outs[i] (a writable contiguous buffer of the raw length). False\n"
"means 'not shown OK here' (None, another codec, any failed check, or a buffer\n"
"that is not contiguous/writable); the caller then runs the general decoder.\n"
"The GIL is released while the blocks are checked and copied.");

static PyObject *read_raw_many(PyObject *self, PyObject *args) {
    PyObject *values_in, *keys_in, *outs_in;
    Py_buffer magic, ns, layout;
    unsigned char version;
    if (!PyArg_ParseTuple(args, "OOOy*by*y*", &values_in, &keys_in, &outs_in, &magic, &version, &ns, &layout))
        return NULL;
    PyObject *result = NULL, *values = NULL, *keys = NULL, *outs = NULL;
    item_t *items = NULL;
    Py_ssize_t n = 0;
    if (!PyList_Check(values_in) || !PyList_Check(keys_in) || !PyList_Check(outs_in)) {
        PyErr_SetString(PyExc_TypeError, "values, keys and outs must be lists");
        goto done;
    }
    /* tuples: fixed items and length, whatever a buffer exporter does to the lists */
    values = PyList_AsTuple(values_in);
    keys = PyList_AsTuple(keys_in);
    outs = PyList_AsTuple(outs_in);
    if (values == NULL || keys == NULL || outs == NULL) goto done;
    n = PyTuple_GET_SIZE(values);
    if (PyTuple_GET_SIZE(keys) != n || PyTuple_GET_SIZE(outs) != n) {
        n = 0;
        PyErr_SetString(PyExc_ValueError, "values, keys and outs must have the same length");
        goto done;
    }
    if (magic.len != 4 || ns.len != NS_LEN || layout.len != LAYOUT_LEN) {
        n = 0;
        PyErr_SetString(PyExc_ValueError, "magic must be 4 bytes, namespace_digest 16, layout_hash 8");
        goto done;
    }
    items = (item_t *)PyMem_Calloc(n ? (size_t)n : 1, sizeof(item_t));
    if (items == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        item_t *it = &items[i];
        PyObject *key = PyTuple_GET_ITEM(keys, i), *value = PyTuple_GET_ITEM(values, i);
        if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) != KEY_LEN) {
            PyErr_SetString(PyExc_TypeError, "every key must be 16 bytes");
            goto done;
        }
        memcpy(it->key, PyBytes_AS_STRING(key), KEY_LEN);
        if (value == Py_None) continue;
        if (PyObject_GetBuffer(value, &it->value, PyBUF_SIMPLE) != 0) {
            PyErr_Clear();
            continue;
        }
        it->have_value = 1;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(outs, i), &it->out, PyBUF_SIMPLE | PyBUF_WRITABLE) != 0) {
            PyErr_Clear();
            continue;
        }
        it->have_out = 1;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        item_t *it = &items[i];
        it->ok = it->have_value && it->have_out &&
                 read_one(it, (const unsigned char *)magic.buf, version, (const unsigned char *)ns.buf,
                          (const unsigned char *)layout.buf);
    }
    Py_END_ALLOW_THREADS
    result = PyList_New(n);
    if (result == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = items[i].ok ? Py_True : Py_False;
        Py_INCREF(b);
        PyList_SET_ITEM(result, i, b);
    }
done:
    if (items != NULL) {
        for (Py_ssize_t i = 0; i < n; i++) {
            if (items[i].have_value) PyBuffer_Release(&items[i].value);
            if (items[i].have_out) PyBuffer_Release(&items[i].out);
        }
        PyMem_Free(items);
    }
    Py_XDECREF(values);
    Py_XDECREF(keys);
    Py_XDECREF(outs);
    PyBuffer_Release(&magic);
    PyBuffer_Release(&ns);
    PyBuffer_Release(&layout);
    return result;
}

PyDoc_STRVAR(copy_sum_many_doc,
"copy_sum_many(dsts, srcs) -> list[int]\n\n"
"For each i: copy srcs[i] (a contiguous buffer) to the start of dsts[i] (a\n"
"writable contiguous buffer at least as long) and return the XXH3-64 of the\n"
"copied bytes, read back from dsts[i] while they are in cache. The write path of\n"
"raw values (their payload's checksum is in the header). The GIL is released\n"
"while the blocks are copied and summed. Raises ValueError for a destination\n"
"that is too short (nothing is copied then).");

static PyObject *copy_sum_many(PyObject *self, PyObject *args) {
    PyObject *dsts_in, *srcs_in;
    if (!PyArg_ParseTuple(args, "OO", &dsts_in, &srcs_in)) return NULL;
    if (!PyList_Check(dsts_in) || !PyList_Check(srcs_in)) {
        PyErr_SetString(PyExc_TypeError, "dsts and srcs must be lists");
        return NULL;
    }
    PyObject *dsts = PyList_AsTuple(dsts_in), *srcs = PyList_AsTuple(srcs_in), *result = NULL;
    Py_buffer *bufs = NULL;
    uint64_t *sums = NULL;
    Py_ssize_t n = 0, got = 0; /* got: buffers acquired (2 per item) */
    if (dsts == NULL || srcs == NULL) goto done;
    n = PyTuple_GET_SIZE(dsts);
    if (PyTuple_GET_SIZE(srcs) != n) {
        PyErr_SetString(PyExc_ValueError, "dsts and srcs must have the same length");
        goto done;
    }
    bufs = (Py_buffer *)PyMem_Calloc(2 * (size_t)(n ? n : 1), sizeof(Py_buffer));
    sums = (uint64_t *)PyMem_Calloc((size_t)(n ? n : 1), sizeof(uint64_t));
    if (bufs == NULL || sums == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(dsts, i), &bufs[got], PyBUF_SIMPLE | PyBUF_WRITABLE) != 0) goto done;
        got++;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(srcs, i), &bufs[got], PyBUF_SIMPLE) != 0) goto done;
        got++;
        if (bufs[got - 2].len < bufs[got - 1].len) {
            PyErr_Format(PyExc_ValueError, "dsts[%zd] holds %zd bytes, srcs[%zd] has %zd", i, bufs[got - 2].len, i,
                         bufs[got - 1].len);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        memmove(bufs[2 * i].buf, bufs[2 * i + 1].buf, (size_t)bufs[2 * i + 1].len);
        sums[i] = xxh3_64(bufs[2 * i].buf, (size_t)bufs[2 * i + 1].len);
    }
    Py_END_ALLOW_THREADS
    result = PyList_New(n);
    if (result == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(sums[i]);
        if (v == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, v);
    }
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&bufs[i]);
    PyMem_Free(bufs);
    PyMem_Free(sums);
    Py_XDECREF(dsts);
    Py_XDECREF(srcs);
    return result;
}

PyDoc_STRVAR(xxh3_doc, "xxh3_64(buffer) -> int: XXH3-64 of a contiguous buffer, through the bound function.");

static PyObject *py_xxh3_64(PyObject *self, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) != 0) return NULL;
    uint64_t h = xxh3_64(b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(h);
}

static PyMethodDef methods[] = {
    {"read_raw_many", read_raw_many, METH_VARARGS, read_raw_many_doc},
    {"copy_sum_many", copy_sum_many, METH_VARARGS, copy_sum_many_doc},
    {"xxh3_64", py_xxh3_64, METH_O, xxh3_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rawread", NULL, -1, methods};

/* Bind XXH3_64bits from the loaded xxhash extension and check it on a test buffer. */
static int bind_xxh3(void) {
    PyObject *mod = PyImport_ImportModule("xxhash._xxhash");
    if (mod == NULL) return -1;
    PyObject *file = PyObject_GetAttrString(mod, "__file__");
    Py_DECREF(mod);
    if (file == NULL) return -1;
    const char *path = PyUnicode_AsUTF8(file);
    if (path == NULL) {
        Py_DECREF(file);
        return -1;
    }
    void *handle = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    Py_DECREF(file);
    if (handle == NULL) {
        PyErr_SetString(PyExc_ImportError, "xxhash extension module is not loaded");
        return -1;
    }
    /* the dispatching entry (AVX2 / AVX-512 where the CPU has them) is what the Python binding
       calls; the plain one is the library's scalar/SSE2 build, half as fast here */
    xxh3_fn fn = (xxh3_fn)dlsym(handle, "XXH3_64bits_dispatch");
    if (fn == NULL) fn = (xxh3_fn)dlsym(handle, "XXH3_64bits");
    if (fn == NULL) {
        PyErr_SetString(PyExc_ImportError, "xxhash extension module does not export XXH3_64bits");
        return -1;
    }
    /* checked against the Python binding, also covering byte order and the header's le64 reads */
    unsigned char probe[HEADER_BYTES * 3];
    for (size_t i = 0; i < sizeof probe; i++) probe[i] = (unsigned char)(i * 131u + 7u);
    PyObject *xx = PyImport_ImportModule("xxhash");
    if (xx == NULL) return -1;
    PyObject *want = PyObject_CallMethod(xx, "xxh3_64_intdigest", "y#", (const char *)probe, (Py_ssize_t)sizeof probe);
    Py_DECREF(xx);
    if (want == NULL) return -1;
    unsigned long long w = PyLong_AsUnsignedLongLong(want);
    Py_DECREF(want);
    if (PyErr_Occurred()) return -1;
    unsigned char le[8];
    uint64_t h = fn(probe, sizeof probe);
    for (int i = 0; i < 8; i++) le[i] = (unsigned char)(h >> (8 * i));
    if ((uint64_t)w != h || le64(le) != h) {
        PyErr_SetString(PyExc_ImportError, "bound XXH3_64bits disagrees with xxhash.xxh3_64_intdigest");
        return -1;
    }
    xxh3_64 = fn;
    return 0;
}

PyMODINIT_FUNC PyInit__rawread(void) {
    if (bind_xxh3() != 0) {
        /* any failure to bind is an ImportError, which kvtier.tiers.codec takes as "use Python" */
        if (!PyErr_ExceptionMatches(PyExc_ImportError)) {
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyErr_NormalizeException(&type, &value, &tb);
            PyErr_Format(PyExc_ImportError, "cannot bind XXH3_64bits: %S", value ? value : Py_None);
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
        }
        return NULL;
    }
    return PyModule_Create(&module);
}
