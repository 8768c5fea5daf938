/* kvtier.tiers._rawread: the read path for ``raw`` values, in C (and the copy +
checksum of the write path: copy_sum_many and sum_many, used by the remote
tier's puts; copy_many, a host copy split with a second thread, used by the
vLLM connector's DRAM copies; copy_spans, the connector's one-pass gather and
scatter between the engine's KV cache and pool rows; and read_raw_scatter, the
connector's SSD load: values checked where they are in the map, then copied
straight into the engine's blocks).

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
addresses of xxHash's calls and copy_many's worker thread (started on first use,
again in a forked child; it spins for SPIN_NS after each copy, then sleeps).

XXH3-64 is not implemented here: the module links against the xxHash
library (libxxhash.so.0, the Debian/Ubuntu package libxxhash0) and calls its
public API (xxhash.h, v0.8), declared below; the CPU-dispatching entries of
xxh_x86dispatch.h (AVX2 / AVX-512), which x86 builds of the library export,
are preferred. At import the bound function is checked against the xxhash
package's xxh3_64_intdigest on a test buffer. Where the library is absent the
build skips this module (setup.py); where the check fails, importing it fails;
either way kvtier stays on the pure-Python path. Measured against the earlier
binding into the xxhash package's module (xxHash 0.8.3 there, Debian's 0.8.1
here; same process, alternating, medians of 9): copy_sum_many 0.95x (256 KiB
and 2 MiB values), a bare 1 MiB sum 0.8x -- the copy, not the sum, bounds it.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* xxHash's public API (xxhash.h and xxh_x86dispatch.h, v0.8), with the opaque XXH3_state_t*
   as void* and XXH_errorcode as int (0 = XXH_OK). The dispatching entries are weak: a
   library built without them still links, and the plain entries are used. */
extern uint64_t XXH3_64bits(const void *input, size_t length);
extern void *XXH3_createState(void);
extern int XXH3_freeState(void *state);
extern int XXH3_64bits_reset(void *state);
extern int XXH3_64bits_update(void *state, const void *input, size_t length);
extern uint64_t XXH3_64bits_digest(const void *state);
extern uint64_t XXH3_64bits_dispatch(const void *input, size_t length) __attribute__((weak));
extern int XXH3_64bits_update_dispatch(void *state, const void *input, size_t length) __attribute__((weak));

typedef uint64_t (*xxh3_fn)(const void *, size_t);
static xxh3_fn xxh3_64 = NULL;

/* xxHash's streaming XXH3-64 (same result as the one-shot call, checked at import): a copy
   sums each chunk right after copying it, while it is still in L1, instead of reading the
   whole destination back from L2/L3 afterwards. Left NULL where a chunked sum disagrees
   with the one-shot one (checked at import): the copy is then followed by one-shot sums. */
typedef void *(*state_new_fn)(void);
typedef int (*state_free_fn)(void *);
typedef int (*reset_fn)(void *);
typedef int (*update_fn)(void *, const void *, size_t);
typedef uint64_t (*digest_fn)(const void *);
static state_new_fn xxh3_state_new = NULL;
static state_free_fn xxh3_state_free = NULL;
static reset_fn xxh3_reset = NULL;
static update_fn xxh3_update = NULL;
static digest_fn xxh3_digest = NULL;
/* copied, then summed while in L1/L2; a value under 8 chunks is copied, then summed whole (it stays in L2).
   Measured (copy + sum, GB/s, one thread): 1 MiB 9.1 vs 9.8 chunked, 4 MiB 7.1 vs 9.6; 256 KiB 10.2 either way */
enum { COPY_CHUNK = 64 * 1024 };

/* Copy n bytes from src to dst and return their XXH3-64. state: a streaming state, or NULL. */
static uint64_t copy_sum(void *dst, const void *src, size_t n, void *state) {
    const unsigned char *s = (const unsigned char *)src;
    unsigned char *d = (unsigned char *)dst;
    int overlap = d < s + n && s < d + n;
    if (state == NULL || overlap || n < 8 * COPY_CHUNK || xxh3_reset(state) != 0) {
        memmove(d, s, n); /* memmove: a caller's buffer may overlap the value */
        return xxh3_64(d, n);
    }
    for (size_t off = 0; off < n; off += COPY_CHUNK) {
        size_t c = n - off < COPY_CHUNK ? n - off : COPY_CHUNK;
        memcpy(d + off, s + off, c);
        xxh3_update(state, d + off, c); /* the bytes as they landed */
    }
    return xxh3_digest(state);
}

static void *new_state(void) { return xxh3_state_new != NULL ? xxh3_state_new() : NULL; }

static void free_state(void *state) {
    if (state != NULL) xxh3_state_free(state);
}

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

/* Every header check of codec._decode_raw_fast for the value whose header is v (its payload
   payload_avail bytes long): 1 when it is a raw value of key, in this namespace and layout, of
   raw_len bytes, with its header checksum right. The payload's checksum is the caller's. */
static int header_ok(const unsigned char *v, const unsigned char *key, const unsigned char *magic, unsigned version,
                     const unsigned char *ns, const unsigned char *layout, Py_ssize_t payload_avail,
                     Py_ssize_t raw_len_wanted) {
    if (memcmp(v + OFF_MAGIC, magic, 4) != 0 || v[OFF_VERSION] != version || v[OFF_CODEC] != 0) return 0;
    if (v[OFF_FLAGS] != 0 || v[OFF_FLAGS + 1] != 0) return 0;
    if (memcmp(v + OFF_KEY, key, KEY_LEN) != 0 || memcmp(v + OFF_NS, ns, NS_LEN) != 0 ||
        memcmp(v + OFF_LAYOUT, layout, LAYOUT_LEN) != 0)
        return 0;
    uint32_t raw_len = le32(v + OFF_RAW_LEN), payload_len = le32(v + OFF_PAYLOAD_LEN);
    if (le32(v + OFF_PLANE0_LEN) != 0 || payload_len != raw_len || (Py_ssize_t)payload_len != payload_avail)
        return 0;
    if (raw_len_wanted != (Py_ssize_t)raw_len) return 0;
    return xxh3_64(v, FIELDS_BYTES) == le64(v + FIELDS_BYTES);
}

/* One block, GIL released: 1 only when every check of codec._decode_raw_fast holds.
   in_place: the value's payload was read straight into out, and value holds its header alone. */
static int read_one(const item_t *it, const unsigned char *magic, unsigned version, const unsigned char *ns,
                    const unsigned char *layout, void *state, int in_place) {
    const unsigned char *v = (const unsigned char *)it->value.buf;
    Py_ssize_t vlen = it->value.len;
    if (vlen < HEADER_BYTES || (in_place && vlen != HEADER_BYTES)) return 0;
    Py_ssize_t payload_avail = in_place ? it->out.len : vlen - HEADER_BYTES;
    if (!header_ok(v, it->key, magic, version, ns, layout, payload_avail, it->out.len)) return 0;
    size_t raw_len = (size_t)it->out.len;
    if (in_place) return xxh3_64(it->out.buf, raw_len) == le64(v + OFF_RAW_SUM);
    return copy_sum(it->out.buf, v + HEADER_BYTES, raw_len, state) == le64(v + OFF_RAW_SUM);
}

PyDoc_STRVAR(read_raw_many_doc,
"read_raw_many(values, keys, outs, magic, version, namespace_digest, layout_hash) -> list[bool]\n\n"
"For each i: True when values[i] is a raw value written for keys[i] (16 bytes)\n"
"in this namespace and layout, both its checksums verify, and its payload was\n"
"copied into outs[i] (a writable contiguous buffer of the raw length). False\n"
"means 'not shown OK here' (None, another codec, any failed check, or a buffer\n"
"that is not contiguous/writable); the caller then runs the general decoder.\n"
"in_place (default False): each payload was read straight into outs[i] and\n"
"values[i] is the value's 96-byte header alone; the payload is checked where it is.\n"
"The GIL is released while the blocks are checked and copied.");

static PyObject *read_raw_many(PyObject *self, PyObject *args) {
    PyObject *values_in, *keys_in, *outs_in;
    Py_buffer magic, ns, layout;
    unsigned char version;
    int in_place = 0;
    if (!PyArg_ParseTuple(args, "OOOy*by*y*|p", &values_in, &keys_in, &outs_in, &magic, &version, &ns, &layout,
                          &in_place))
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
    void *state = new_state();
    for (Py_ssize_t i = 0; i < n; i++) {
        item_t *it = &items[i];
        it->ok = it->have_value && it->have_out &&
                 read_one(it, (const unsigned char *)magic.buf, version, (const unsigned char *)ns.buf,
                          (const unsigned char *)layout.buf, state, in_place);
    }
    free_state(state);
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

PyDoc_STRVAR(read_raw_scatter_doc,
"read_raw_scatter(values, keys, dsts, table, magic, version, namespace_digest, layout_hash) -> int\n\n"
"The read path of read_raw_many with no buffer between the value and where its bytes go:\n"
"each value is checked as read_raw_many checks it (header, then the payload's XXH3-64 where\n"
"it is, in the map) and only then copied straight into spans of the buffers dsts\n"
"(writable, contiguous). table is an int64 [m, 4] array of (block index into values, dst\n"
"index, dst offset, length), grouped by block in increasing order and, within a block, in\n"
"payload order: a block's spans tile its payload from offset 0, and their total must be\n"
"its raw length. Returns k: values[:k] were shown OK and landed; the first value not shown\n"
"OK stops the call, and nothing of it or after it is written (the caller reads those again\n"
"through the general path, which says why). Raises ValueError, nothing copied, for a table\n"
"outside its buffers or out of order.\n"
"The GIL is released while the blocks are checked and copied.");

typedef struct {
    unsigned char *dst;
    size_t n;
} land_t;

/* Copy n bytes to d (16-byte aligned: the engine's blocks are) with non-temporal stores where
   the CPU has them: a load's blocks go to memory the forward reads next, too large to stay in
   cache, and a plain store first reads each destination line in (measured on the worker's
   whole SSD load path: 0.49-0.64x a warm read against 0.39-0.46x with memcpy). */
static void copy_streaming(unsigned char *d, const unsigned char *s, size_t n) {
    size_t i = 0;
#if defined(__SSE2__)
    if (((uintptr_t)d & 15) == 0)
        for (; i + 64 <= n; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(s + i)), b = _mm_loadu_si128((const __m128i *)(s + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32)), e = _mm_loadu_si128((const __m128i *)(s + i + 48));
            _mm_stream_si128((__m128i *)(d + i), a);
            _mm_stream_si128((__m128i *)(d + i + 16), b);
            _mm_stream_si128((__m128i *)(d + i + 32), c);
            _mm_stream_si128((__m128i *)(d + i + 48), e);
        }
#endif
    memcpy(d + i, s + i, n - i);
}

static void streaming_done(void) {
#if defined(__SSE2__)
    _mm_sfence(); /* the non-temporal stores are visible before the load is reported */
#endif
}

static PyObject *read_raw_scatter(PyObject *self, PyObject *args) {
    PyObject *values_in, *keys_in, *dsts_in, *table_in;
    Py_buffer magic, ns, layout, table;
    unsigned char version;
    if (!PyArg_ParseTuple(args, "OOOOy*by*y*", &values_in, &keys_in, &dsts_in, &table_in, &magic, &version, &ns,
                          &layout))
        return NULL;
    PyObject *result = NULL, *values = NULL, *keys_t = NULL, *dsts = NULL;
    Py_buffer *vals = NULL, *dbufs = NULL;
    unsigned char(*keys)[KEY_LEN] = NULL;
    land_t *lands = NULL;
    Py_ssize_t *first = NULL; /* first[b]: the first span of block b; first[n]: m */
    Py_ssize_t n = 0, nd = 0, got_vals = 0, got_dsts = 0, landed = 0;
    int have_table = 0;
    if (!PyList_Check(values_in) || !PyList_Check(keys_in) || !PyList_Check(dsts_in)) {
        PyErr_SetString(PyExc_TypeError, "values, keys and dsts must be lists");
        goto done;
    }
    if (magic.len != 4 || ns.len != NS_LEN || layout.len != LAYOUT_LEN) {
        PyErr_SetString(PyExc_ValueError, "magic must be 4 bytes, namespace_digest 16, layout_hash 8");
        goto done;
    }
    if (PyObject_GetBuffer(table_in, &table, PyBUF_C_CONTIGUOUS) != 0) goto done;
    have_table = 1;
    if (table.len % (4 * (Py_ssize_t)sizeof(int64_t)) != 0) {
        PyErr_SetString(PyExc_ValueError, "table must hold rows of 4 int64");
        goto done;
    }
    /* tuples: fixed items and length, whatever a buffer exporter does to the lists */
    values = PyList_AsTuple(values_in);
    keys_t = PyList_AsTuple(keys_in);
    dsts = PyList_AsTuple(dsts_in);
    if (values == NULL || keys_t == NULL || dsts == NULL) goto done;
    n = PyTuple_GET_SIZE(values);
    nd = PyTuple_GET_SIZE(dsts);
    if (PyTuple_GET_SIZE(keys_t) != n) {
        PyErr_SetString(PyExc_ValueError, "values and keys must have the same length");
        goto done;
    }
    Py_ssize_t m = table.len / (4 * (Py_ssize_t)sizeof(int64_t));
    vals = (Py_buffer *)PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    keys = PyMem_Calloc((size_t)(n ? n : 1), KEY_LEN);
    dbufs = (Py_buffer *)PyMem_Calloc((size_t)(nd ? nd : 1), sizeof(Py_buffer));
    lands = (land_t *)PyMem_Calloc((size_t)(m ? m : 1), sizeof(land_t));
    first = (Py_ssize_t *)PyMem_Calloc((size_t)n + 1, sizeof(Py_ssize_t));
    if (vals == NULL || keys == NULL || dbufs == NULL || lands == NULL || first == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got_dsts < nd; got_dsts++)
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(dsts, got_dsts), &dbufs[got_dsts],
                               PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0)
            goto done;
    const int64_t *t = (const int64_t *)table.buf;
    Py_ssize_t b = 0, last = 0; /* first[] is set below b; last: the block of the span before */
    for (Py_ssize_t i = 0; i < m; i++, t += 4) {
        int64_t blk = t[0], di = t[1], doff = t[2], len = t[3];
        if (blk < last || blk >= n || di < 0 || di >= nd || doff < 0 || len < 0 || doff > dbufs[di].len - len) {
            PyErr_Format(PyExc_ValueError, "span %zd (block %lld, dst %lld at %lld, %lld bytes) is out of order "
                         "or outside its buffers", i, (long long)blk, (long long)di, (long long)doff, (long long)len);
            goto done;
        }
        while (b <= blk) first[b++] = i;
        last = (Py_ssize_t)blk;
        lands[i] = (land_t){(unsigned char *)dbufs[di].buf + doff, (size_t)len};
    }
    while (b <= n) first[b++] = m;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyTuple_GET_ITEM(keys_t, i);
        if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) != KEY_LEN) {
            PyErr_SetString(PyExc_TypeError, "every key must be 16 bytes");
            goto done;
        }
        memcpy(keys[i], PyBytes_AS_STRING(key), KEY_LEN);
    }
    for (; got_vals < n; got_vals++) { /* up to the first absent value: nothing after it lands */
        PyObject *value = PyTuple_GET_ITEM(values, got_vals);
        if (value == Py_None || PyObject_GetBuffer(value, &vals[got_vals], PyBUF_SIMPLE) != 0) {
            PyErr_Clear();
            break;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (; landed < got_vals; landed++) {
        const unsigned char *v = (const unsigned char *)vals[landed].buf;
        Py_ssize_t vlen = vals[landed].len;
        uint64_t total = 0; /* (spans may overlap: no sum of theirs is bounded by a buffer) */
        for (Py_ssize_t i = first[landed]; i < first[landed + 1] && total <= UINT32_MAX; i++) total += lands[i].n;
        /* verified before a byte lands: the destination never holds an unverified value
           (summing the bytes as they land instead measured the same: 8.4-9.1 against
           8.6-8.7 GB/s at 256 KiB and 4 MiB blocks, one thread) */
        if (vlen < HEADER_BYTES || total > UINT32_MAX ||
            !header_ok(v, keys[landed], (const unsigned char *)magic.buf, version, (const unsigned char *)ns.buf,
                       (const unsigned char *)layout.buf, vlen - HEADER_BYTES, (Py_ssize_t)total) ||
            xxh3_64(v + HEADER_BYTES, (size_t)total) != le64(v + OFF_RAW_SUM))
            break;
        const unsigned char *src = v + HEADER_BYTES;
        for (Py_ssize_t i = first[landed]; i < first[landed + 1]; src += lands[i].n, i++)
            copy_streaming(lands[i].dst, src, lands[i].n);
    }
    streaming_done();
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(landed);
done:
    for (Py_ssize_t i = 0; i < got_vals; i++) PyBuffer_Release(&vals[i]);
    for (Py_ssize_t i = 0; i < got_dsts; i++) PyBuffer_Release(&dbufs[i]);
    PyMem_Free(vals);
    PyMem_Free(keys);
    PyMem_Free(dbufs);
    PyMem_Free(lands);
    PyMem_Free(first);
    Py_XDECREF(values);
    Py_XDECREF(keys_t);
    Py_XDECREF(dsts);
    if (have_table) PyBuffer_Release(&table);
    PyBuffer_Release(&magic);
    PyBuffer_Release(&ns);
    PyBuffer_Release(&layout);
    return result;
}

PyDoc_STRVAR(copy_sum_many_doc,
"copy_sum_many(dsts, srcs) -> list[int]\n\n"
"For each i: copy srcs[i] (a contiguous buffer) to the start of dsts[i] (a\n"
"writable contiguous buffer at least as long) and return the XXH3-64 of the\n"
"copied bytes, summed chunk by chunk from dsts[i] as they land. The write path of\n"
"raw values (their payload's checksum is in the header). The GIL is released\n"
"while the blocks are copied and summed. Raises ValueError for a destination\n"
"that is too short (nothing is copied then).");

/* A list of the n sums as Python ints; NULL with an exception set. */
static PyObject *sums_list(const uint64_t *sums, Py_ssize_t n) {
    PyObject *result = PyList_New(n);
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(sums[i]);
        if (v == NULL) {
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, i, v);
    }
    return result;
}

/* The buffers of (dsts[i], srcs[i]) pairs, 2 per item (dst writable, both contiguous, dst at
   least as long as src); NULL with an exception set (nothing held) otherwise. Free with
   release_pairs. */
static Py_buffer *get_pairs(PyObject *dsts_in, PyObject *srcs_in, Py_ssize_t *n_out) {
    if (!PyList_Check(dsts_in) || !PyList_Check(srcs_in)) {
        PyErr_SetString(PyExc_TypeError, "dsts and srcs must be lists");
        return NULL;
    }
    PyObject *dsts = PyList_AsTuple(dsts_in), *srcs = PyList_AsTuple(srcs_in);
    Py_buffer *bufs = NULL;
    Py_ssize_t n = 0, got = 0; /* got: buffers acquired */
    int ok = 0;
    if (dsts == NULL || srcs == NULL) goto done;
    n = PyTuple_GET_SIZE(dsts);
    if (PyTuple_GET_SIZE(srcs) != n) {
        PyErr_SetString(PyExc_ValueError, "dsts and srcs must have the same length");
        goto done;
    }
    bufs = (Py_buffer *)PyMem_Calloc(2 * (size_t)(n ? n : 1), sizeof(Py_buffer));
    if (bufs == NULL) {
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
    ok = 1;
done:
    Py_XDECREF(dsts);
    Py_XDECREF(srcs);
    if (ok) {
        *n_out = n;
        return bufs;
    }
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&bufs[i]);
    PyMem_Free(bufs);
    return NULL;
}

static void release_pairs(Py_buffer *bufs, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < 2 * n; i++) PyBuffer_Release(&bufs[i]);
    PyMem_Free(bufs);
}

static PyObject *copy_sum_many(PyObject *self, PyObject *args) {
    PyObject *dsts_in, *srcs_in, *result = NULL;
    Py_ssize_t n = 0;
    if (!PyArg_ParseTuple(args, "OO", &dsts_in, &srcs_in)) return NULL;
    Py_buffer *bufs = get_pairs(dsts_in, srcs_in, &n);
    if (bufs == NULL) return NULL;
    uint64_t *sums = (uint64_t *)PyMem_Calloc((size_t)(n ? n : 1), sizeof(uint64_t));
    if (sums == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    void *state = new_state();
    for (Py_ssize_t i = 0; i < n; i++)
        sums[i] = copy_sum(bufs[2 * i].buf, bufs[2 * i + 1].buf, (size_t)bufs[2 * i + 1].len, state);
    free_state(state);
    Py_END_ALLOW_THREADS
    result = sums_list(sums, n);
done:
    release_pairs(bufs, n);
    PyMem_Free(sums);
    return result;
}


/* ---- copy_many: one copy split with a second thread that stays awake between copies ----
   A host copy of a few MiB gains from a second core only when that core starts at once: a
   thread pool's worker that has gone to sleep takes about as long to wake (longer on a VM,
   whose idle vCPU the hypervisor parks) as the copy it would share. This worker spins for
   SPIN_NS after each part before it sleeps, as an OpenMP team does: a burst of copies finds
   it awake. One copy at a time (copy_lock); a forked child starts its own worker. */
enum { SPIN_NS = 500000 };

typedef struct {
    unsigned char *dst;
    const unsigned char *src;
    size_t n;
} span_t;

static pthread_mutex_t copy_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t sleep_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static uint64_t job_seq = 0;  /* parts published (atomic) */
static uint64_t job_done = 0; /* parts the worker finished (atomic) */
static span_t *job_spans = NULL;
static size_t job_count = 0;
static pid_t worker_pid = 0; /* the process whose worker runs; 0: none */

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void *copy_worker(void *start) {
    uint64_t seen = (uint64_t)(uintptr_t)start; /* job_seq when it was started: a part published since is its */
    for (;;) {
        uint64_t t0 = now_ns(), seq;
        unsigned spins = 0;
        while ((seq = __atomic_load_n(&job_seq, __ATOMIC_ACQUIRE)) == seen) {
            if ((++spins & 255u) == 0 && now_ns() - t0 > SPIN_NS) {
                pthread_mutex_lock(&sleep_lock);
                while (__atomic_load_n(&job_seq, __ATOMIC_ACQUIRE) == seen) pthread_cond_wait(&wake, &sleep_lock);
                pthread_mutex_unlock(&sleep_lock);
                t0 = now_ns();
            }
            relax();
        }
        seen = seq;
        for (size_t i = 0; i < job_count; i++) memmove(job_spans[i].dst, job_spans[i].src, job_spans[i].n);
        __atomic_store_n(&job_done, seq, __ATOMIC_RELEASE);
    }
    return NULL;
}

/* In a forked child: the parent's worker is not there, and its locks may be held by a thread
   that is not there either. */
static void after_fork_in_child(void) {
    pthread_mutex_init(&copy_lock, NULL);
    pthread_mutex_init(&sleep_lock, NULL);
    pthread_cond_init(&wake, NULL);
    job_seq = job_done = 0;
    worker_pid = 0;
}

/* The worker of this process, started on first use (called under copy_lock); 0 if none can be. */
static int have_worker(void) {
    pid_t pid = getpid();
    if (worker_pid == pid) return 1;
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&t, &attr, copy_worker, (void *)(uintptr_t)__atomic_load_n(&job_seq, __ATOMIC_ACQUIRE));
    pthread_attr_destroy(&attr);
    if (rc != 0) return 0;
    worker_pid = pid;
    return 1;
}

/* Copy spans[0..n): the worker takes the spans (cut at half the bytes) after the cut, this
   thread the rest; back when both are done. Called with the GIL released. */
static void copy_split(span_t *spans, size_t n, span_t *theirs) {
    size_t total = 0, half, acc = 0, cut = 0;
    for (size_t i = 0; i < n; i++) total += spans[i].n;
    half = total / 2;
    while (cut < n && acc + spans[cut].n <= half) acc += spans[cut++].n;
    size_t mine = cut, k = 0;
    if (cut < n) { /* the span across the middle: its head here, its tail there */
        size_t head = half - acc;
        theirs[k++] = (span_t){spans[cut].dst + head, spans[cut].src + head, spans[cut].n - head};
        spans[cut].n = head;
        mine = cut + 1;
        cut++;
    }
    for (size_t i = cut; i < n; i++) theirs[k++] = spans[i];
    pthread_mutex_lock(&copy_lock);
    int parallel = k > 0 && have_worker();
    if (parallel) {
        job_spans = theirs;
        job_count = k;
        uint64_t seq = __atomic_add_fetch(&job_seq, 1, __ATOMIC_ACQ_REL);
        pthread_mutex_lock(&sleep_lock);
        pthread_cond_signal(&wake);
        pthread_mutex_unlock(&sleep_lock);
        for (size_t i = 0; i < mine; i++) memmove(spans[i].dst, spans[i].src, spans[i].n);
        while (__atomic_load_n(&job_done, __ATOMIC_ACQUIRE) != seq) relax();
    } else {
        for (size_t i = 0; i < mine; i++) memmove(spans[i].dst, spans[i].src, spans[i].n);
        for (size_t i = 0; i < k; i++) memmove(theirs[i].dst, theirs[i].src, theirs[i].n);
    }
    pthread_mutex_unlock(&copy_lock);
}

PyDoc_STRVAR(copy_many_doc,
"copy_many(dsts, srcs) -> None\n\n"
"Copy each srcs[i] (a contiguous buffer) to the start of dsts[i] (a writable\n"
"contiguous buffer at least as long), the bytes split between this thread and a\n"
"second one that stays awake between copies. The GIL is released while they copy.\n"
"Raises ValueError for a destination that is too short (nothing is copied then).");

static PyObject *copy_many(PyObject *self, PyObject *args) {
    PyObject *dsts_in, *srcs_in;
    Py_ssize_t n = 0;
    if (!PyArg_ParseTuple(args, "OO", &dsts_in, &srcs_in)) return NULL;
    Py_buffer *bufs = get_pairs(dsts_in, srcs_in, &n);
    if (bufs == NULL) return NULL;
    span_t *spans = (span_t *)PyMem_Calloc(2 * (size_t)(n ? n : 1) + 1, sizeof(span_t)); /* mine, then theirs */
    if (spans == NULL) {
        release_pairs(bufs, n);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++)
        spans[i] = (span_t){(unsigned char *)bufs[2 * i].buf, (const unsigned char *)bufs[2 * i + 1].buf,
                            (size_t)bufs[2 * i + 1].len};
    Py_BEGIN_ALLOW_THREADS
    copy_split(spans, (size_t)n, spans + n);
    Py_END_ALLOW_THREADS
    release_pairs(bufs, n);
    PyMem_Free(spans);
    Py_RETURN_NONE;
}


PyDoc_STRVAR(copy_spans_doc,
"copy_spans(dsts, srcs, table, split) -> None\n\n"
"Copy byte spans between buffers in one pass: table is a C-contiguous int64 buffer\n"
"of rows (dst index, dst offset, src index, src offset, length) naming a span of\n"
"dsts[dst index] (writable) and of srcs[src index]. Every span is checked against\n"
"its buffers' lengths first; a bad one raises ValueError and nothing is copied.\n"
"split: share the bytes with the second thread copy_many uses. The GIL is released\n"
"while they copy. What the vLLM connector's gather and scatter run: each layer's\n"
"bytes of a KV block straight between the engine's cache and a pool row.");

static PyObject *copy_spans(PyObject *self, PyObject *args) {
    PyObject *dsts_in, *srcs_in, *table_in;
    int split = 0;
    if (!PyArg_ParseTuple(args, "OOOp", &dsts_in, &srcs_in, &table_in, &split)) return NULL;
    if (!PyList_Check(dsts_in) || !PyList_Check(srcs_in)) {
        PyErr_SetString(PyExc_TypeError, "dsts and srcs must be lists");
        return NULL;
    }
    Py_ssize_t nd = PyList_GET_SIZE(dsts_in), ns = PyList_GET_SIZE(srcs_in);
    Py_buffer table;
    if (PyObject_GetBuffer(table_in, &table, PyBUF_C_CONTIGUOUS) != 0) return NULL;
    if (table.len % (5 * (Py_ssize_t)sizeof(int64_t)) != 0) {
        PyBuffer_Release(&table);
        PyErr_SetString(PyExc_ValueError, "table must hold rows of 5 int64");
        return NULL;
    }
    Py_ssize_t n = table.len / (5 * (Py_ssize_t)sizeof(int64_t));
    Py_buffer *bufs = (Py_buffer *)PyMem_Calloc((size_t)(nd + ns ? nd + ns : 1), sizeof(Py_buffer));
    span_t *spans = (span_t *)PyMem_Calloc(2 * (size_t)(n ? n : 1) + 1, sizeof(span_t)); /* mine, then theirs */
    Py_ssize_t got = 0;
    PyObject *err = NULL;
    if (bufs == NULL || spans == NULL) {
        err = PyErr_NoMemory();
        goto done;
    }
    for (; got < nd + ns; got++) {
        PyObject *o = got < nd ? PyList_GET_ITEM(dsts_in, got) : PyList_GET_ITEM(srcs_in, got - nd);
        if (PyObject_GetBuffer(o, &bufs[got], got < nd ? PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS : PyBUF_C_CONTIGUOUS) != 0)
            goto done;
    }
    const int64_t *t = (const int64_t *)table.buf;
    for (Py_ssize_t i = 0; i < n; i++, t += 5) {
        int64_t di = t[0], doff = t[1], si = t[2], soff = t[3], len = t[4];
        if (di < 0 || di >= nd || si < 0 || si >= ns || doff < 0 || soff < 0 || len < 0 ||
            doff > bufs[di].len - len || soff > bufs[nd + si].len - len) {
            PyErr_Format(PyExc_ValueError, "span %zd (dst %lld at %lld, src %lld at %lld, %lld bytes) is outside its buffers",
                         i, (long long)di, (long long)doff, (long long)si, (long long)soff, (long long)len);
            goto done;
        }
        spans[i] = (span_t){(unsigned char *)bufs[di].buf + doff, (const unsigned char *)bufs[nd + si].buf + soff,
                            (size_t)len};
    }
    Py_BEGIN_ALLOW_THREADS
    if (split) {
        copy_split(spans, (size_t)n, spans + n);
    } else {
        for (Py_ssize_t i = 0; i < n; i++) memmove(spans[i].dst, spans[i].src, spans[i].n);
    }
    Py_END_ALLOW_THREADS
    err = Py_None;
    Py_INCREF(err);
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&bufs[i]);
    PyMem_Free(bufs);
    PyMem_Free(spans);
    PyBuffer_Release(&table);
    return err;
}


PyDoc_STRVAR(sum_many_doc,
"sum_many(buffers) -> list[int]: the XXH3-64 of each contiguous buffer, with the GIL released\n"
"(the write path of raw values that are sent from where they are, with no copy).");

static PyObject *sum_many(PyObject *self, PyObject *arg) {
    if (!PyList_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "buffers must be a list");
        return NULL;
    }
    PyObject *bufs_t = PyList_AsTuple(arg), *result = NULL;
    if (bufs_t == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(bufs_t), got = 0;
    Py_buffer *bufs = (Py_buffer *)PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    uint64_t *sums = (uint64_t *)PyMem_Calloc((size_t)(n ? n : 1), sizeof(uint64_t));
    if (bufs == NULL || sums == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < n; got++)
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(bufs_t, got), &bufs[got], PyBUF_SIMPLE) != 0) goto done;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) sums[i] = xxh3_64(bufs[i].buf, (size_t)bufs[i].len);
    Py_END_ALLOW_THREADS
    result = sums_list(sums, n);
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&bufs[i]);
    PyMem_Free(bufs);
    PyMem_Free(sums);
    Py_DECREF(bufs_t);
    return result;
}

PyDoc_STRVAR(xxh3_doc, "xxh3_64(buffer) -> int: XXH3-64 of a contiguous buffer, through the bound function.");
PyDoc_STRVAR(streaming_doc,
             "streaming() -> bool: whether copies sum each chunk as it lands (xxHash's streaming calls).");

static PyObject *py_streaming(PyObject *self, PyObject *unused) { return PyBool_FromLong(xxh3_state_new != NULL); }

static PyObject *py_xxh3_64(PyObject *self, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) != 0) return NULL;
    uint64_t h = xxh3_64(b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(h);
}

static PyMethodDef methods[] = {
    {"read_raw_many", read_raw_many, METH_VARARGS, read_raw_many_doc},
    {"read_raw_scatter", read_raw_scatter, METH_VARARGS, read_raw_scatter_doc},
    {"copy_sum_many", copy_sum_many, METH_VARARGS, copy_sum_many_doc},
    {"sum_many", sum_many, METH_O, sum_many_doc},
    {"copy_many", copy_many, METH_VARARGS, copy_many_doc},
    {"copy_spans", copy_spans, METH_VARARGS, copy_spans_doc},
    {"xxh3_64", py_xxh3_64, METH_O, xxh3_doc},
    {"streaming", py_streaming, METH_NOARGS, streaming_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rawread", NULL, -1, methods};

/* Use the streaming XXH3-64 calls where a chunked copy_sum of a probe equals the one-shot
   sum; otherwise leave them unused (copy_sum then copies and sums whole). */
static void bind_streaming(void) {
    update_fn up = XXH3_64bits_update_dispatch != NULL ? XXH3_64bits_update_dispatch : XXH3_64bits_update;
    size_t n = 9 * COPY_CHUNK + 77; /* chunked (8 chunks or more), with a tail */
    unsigned char *src = (unsigned char *)malloc(2 * n);
    void *state = XXH3_createState();
    if (src != NULL && state != NULL) {
        for (size_t i = 0; i < n; i++) src[i] = (unsigned char)(i * 2654435761u >> 13);
        xxh3_state_new = XXH3_createState, xxh3_state_free = XXH3_freeState, xxh3_reset = XXH3_64bits_reset;
        xxh3_update = up, xxh3_digest = XXH3_64bits_digest;
        if (copy_sum(src + n, src, n, state) != xxh3_64(src, n) || memcmp(src, src + n, n) != 0)
            xxh3_state_new = NULL; /* disagrees: not used */
    }
    if (state != NULL) XXH3_freeState(state);
    free(src);
}

/* Choose the library's XXH3_64bits entry and check it against the xxhash package on a test buffer. */
static int bind_xxh3(void) {
    /* the dispatching entry (AVX2 / AVX-512 where the CPU has them) is what the Python binding
       calls; the plain one is the library's scalar/SSE2 build, half as fast here */
    xxh3_fn fn = XXH3_64bits_dispatch != NULL ? XXH3_64bits_dispatch : XXH3_64bits;
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
        PyErr_SetString(PyExc_ImportError, "libxxhash's XXH3_64bits disagrees with xxhash.xxh3_64_intdigest");
        return -1;
    }
    xxh3_64 = fn;
    bind_streaming();
    return 0;
}

PyMODINIT_FUNC PyInit__rawread(void) {
    pthread_atfork(NULL, NULL, after_fork_in_child);
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
