/* kvtier.tiers._rq: the rotation quantizer's loops (kvtier/tiers/rq.py), in C.
 *
 * Owns: per head vector, the randomized Hadamard rotation, the per-vector
 * scale, the Lloyd-Max codes and their bit packing, both ways, for bf16, fp16
 * (where the compiler has _Float16) and fp32 blocks. Must not parse or check
 * value headers (rq.py does), allocate per call, or hold the GIL while it
 * loops. Results equal rq.py's numpy reference: decode bit for bit, encode up
 * to the rounding of a sum of squares (tests/test_rq.py compares them).
 *
 * encode(src, dtype, head_dim, bits, seed, scales_out, codes_out) -> bool
 *     False (nothing meaningful written) when a value is not finite.
 * decode(scales, codes, dtype, head_dim, bits, seed, dst) -> None
 *
 * dtype: 1 bf16, 2 fp16, 3 fp32. head_dim: a power of two, 16..1024. bits: 3 or 4.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

#define MAX_DIM 1024

/* Lloyd-Max quantizer of N(0, 1) (Max 1960), ascending; the same constants are in rq.py */
static const float LM4[16] = {-2.732590f, -2.069017f, -1.618046f, -1.256231f, -0.942340f, -0.656759f,
                              -0.388048f, -0.128395f, 0.128395f,  0.388048f,  0.656759f,  0.942340f,
                              1.256231f,  1.618046f,  2.069017f,  2.732590f};
static const float LM3[8] = {-2.151946f, -1.343909f, -0.756005f, -0.245094f,
                             0.245094f,  0.756005f,  1.343909f,  2.151946f};

static uint64_t splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* sign of coordinate i: bit i % 64 of the (i / 64)-th splitmix64 output of the seed */
static void make_signs(uint32_t seed, int d, float *signs) {
    uint64_t state = seed, z = 0;
    for (int i = 0; i < d; i++) {
        if (i % 64 == 0) z = splitmix64(&state);
        signs[i] = ((z >> (i % 64)) & 1) ? -1.0f : 1.0f;
    }
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; inputs are finite */
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* In-place Walsh-Hadamard transform (unnormalized) of d floats, d a multiple of 8:
 * stages h = 1, 2, 4 inside each run of 8, then h = 8, 16, ... across runs. Each
 * butterfly is (a + b, a - b) of the pair (j, j + h), in this stage order, as in rq.py.
 * fwht_from2() is the transform less its first stage (h = 1), which the decoder's
 * lookup table makes. */
static inline void fwht_from2(float *x, int d) {
    const v8f m2 = {1, 1, -1, -1, 1, 1, -1, -1}, m4 = {1, 1, 1, 1, -1, -1, -1, -1};
    const v8i p2 = {2, 3, 0, 1, 6, 7, 4, 5}, p4 = {4, 5, 6, 7, 0, 1, 2, 3};
    for (int i = 0; i < d; i += 8) {
        v8f v, b;
        memcpy(&v, x + i, 32);
        b = __builtin_shuffle(v, p2);
        v = b + m2 * v; /* lower lane: partner + self = a + b; upper: partner - self = a - b */
        b = __builtin_shuffle(v, p4);
        v = b + m4 * v;
        memcpy(x + i, &v, 32);
    }
    for (int h = 8; h < d; h <<= 1)
        for (int i = 0; i < d; i += 2 * h)
            for (int j = i; j < i + h; j += 8) {
                v8f a, b, s, t;
                memcpy(&a, x + j, 32);
                memcpy(&b, x + j + h, 32);
                s = a + b;
                t = a - b;
                memcpy(x + j, &s, 32);
                memcpy(x + j + h, &t, 32);
            }
}

static inline void fwht(float *x, int d) {
    const v8f m1 = {1, -1, 1, -1, 1, -1, 1, -1};
    const v8i p1 = {1, 0, 3, 2, 5, 4, 7, 6};
    for (int i = 0; i < d; i += 8) {
        v8f v, b;
        memcpy(&v, x + i, 32);
        b = __builtin_shuffle(v, p1);
        v = b + m1 * v;
        memcpy(x + i, &v, 32);
    }
    fwht_from2(x, d);
}

static int load_vec(const char *src, int dtype, int d, float *x) {
    if (dtype == 1) {
        const uint16_t *s = (const uint16_t *)src;
        for (int j = 0; j < d; j++) x[j] = bf16_to_f32(s[j]);
    } else if (dtype == 3) {
        memcpy(x, src, (size_t)d * 4);
    } else {
#ifdef __FLT16_MAX__
        const _Float16 *s = (const _Float16 *)src;
        for (int j = 0; j < d; j++) x[j] = (float)s[j];
#else
        return 0;
#endif
    }
    return 1;
}

static void store_vec(const float *x, int dtype, int d, char *dst) {
    if (dtype == 1) {
        uint16_t *o = (uint16_t *)dst;
        for (int j = 0; j < d; j++) o[j] = f32_to_bf16(x[j]);
    } else if (dtype == 3) {
        memcpy(dst, x, (size_t)d * 4);
    } else {
#ifdef __FLT16_MAX__
        _Float16 *o = (_Float16 *)dst;
        for (int j = 0; j < d; j++) o[j] = (_Float16)x[j];
#endif
    }
}

typedef double v4d __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

/* 0 on success, 1 on a non-finite value */
__attribute__((target_clones("avx2", "default")))
static int encode_loop(const char *src, Py_ssize_t n, int dtype, int d, int bits, uint32_t seed,
                       uint16_t *scales, uint8_t *codes) {
    float signs[MAX_DIM] __attribute__((aligned(32))), x[MAX_DIM] __attribute__((aligned(32)));
    int32_t q[MAX_DIM] __attribute__((aligned(32)));
    v8f bounds[15];
    const int levels = 1 << bits;
    const float *lv = bits == 4 ? LM4 : LM3;
    const int elem = dtype == 3 ? 4 : 2;
    const float inv_sqrt_d = 1.0f / sqrtf((float)d);
    make_signs(seed, d, signs);
    for (int k = 0; k < levels - 1; k++) {
        const float b = 0.5f * (lv[k] + lv[k + 1]);
        bounds[k] = (v8f){b, b, b, b, b, b, b, b};
    }
    uint8_t *out = codes;
    for (Py_ssize_t v = 0; v < n; v++) {
        if (!load_vec(src + v * (Py_ssize_t)d * elem, dtype, d, x)) return 2;
        v4d acc = {0, 0, 0, 0};
        for (int j = 0; j < d; j += 4) {
            v4f f4;
            memcpy(&f4, x + j, 16);
            v4d x4 = __builtin_convertvector(f4, v4d);
            acc += x4 * x4;
        }
        const double ss = (acc[0] + acc[1]) + (acc[2] + acc[3]);
        const float rms = (float)sqrt(ss / d);
        if (!isfinite(rms)) return 1;
        const uint16_t sb = f32_to_bf16(rms);
        const float scale = bf16_to_f32(sb);
        if (!isfinite(scale)) return 1;
        scales[v] = sb;
        for (int j = 0; j < d; j++) x[j] *= signs[j];
        fwht(x, d);
        const float inv = scale > 0.0f ? inv_sqrt_d / scale : 0.0f;
        const v8f vinv = {inv, inv, inv, inv, inv, inv, inv, inv};
        for (int j = 0; j < d; j += 8) {
            v8f y;
            memcpy(&y, x + j, 32);
            y *= vinv;
            v8i c = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int k = 0; k < levels - 1; k++) c -= (v8i)(y > bounds[k]);
            memcpy(q + j, &c, 32);
        }
        if (bits == 4) {
            for (int j = 0; j < d; j += 2) *out++ = (uint8_t)(q[j] | (q[j + 1] << 4));
        } else {
            for (int j = 0; j < d; j += 8) {
                uint32_t w = 0;
                for (int i = 0; i < 8; i++) w |= (uint32_t)q[j + i] << (3 * i);
                *out++ = (uint8_t)w;
                *out++ = (uint8_t)(w >> 8);
                *out++ = (uint8_t)(w >> 16);
            }
        }
    }
    return 0;
}

/* Stage h = 1 of the transform is folded into the lookup: a byte (4 bits) or a
 * 6-bit field (3 bits) holds codes (c0, c1), and the table holds
 * (level[c0] + level[c1], level[c0] - level[c1]), the floats that stage makes. */
__attribute__((target_clones("avx2", "default")))
static int decode_loop(const uint16_t *scales, const uint8_t *codes, Py_ssize_t n, int dtype, int d, int bits,
                       uint32_t seed, char *dst) {
    float signs[MAX_DIM] __attribute__((aligned(32))), x[MAX_DIM] __attribute__((aligned(32)));
    float pairs[256][2];
    const int elem = dtype == 3 ? 4 : 2;
    const float inv_sqrt_d = 1.0f / sqrtf((float)d);
    make_signs(seed, d, signs);
    const int shift = bits == 4 ? 4 : 3, mask = (1 << shift) - 1;
    const float *lv = bits == 4 ? LM4 : LM3;
    for (int b = 0; b < (1 << (2 * shift)); b++) {
        const float l0 = lv[b & mask], l1 = lv[b >> shift];
        pairs[b][0] = l0 + l1;
        pairs[b][1] = l0 - l1;
    }
    const uint8_t *in = codes;
    for (Py_ssize_t v = 0; v < n; v++) {
        const float f = bf16_to_f32(scales[v]) * inv_sqrt_d;
        if (bits == 4) {
            for (int j = 0; j < d; j += 2) memcpy(x + j, pairs[*in++], 8);
        } else {
            for (int j = 0; j < d; j += 8) {
                const uint32_t w = (uint32_t)in[0] | ((uint32_t)in[1] << 8) | ((uint32_t)in[2] << 16);
                in += 3;
                memcpy(x + j, pairs[w & 63], 8);
                memcpy(x + j + 2, pairs[(w >> 6) & 63], 8);
                memcpy(x + j + 4, pairs[(w >> 12) & 63], 8);
                memcpy(x + j + 6, pairs[(w >> 18) & 63], 8);
            }
        }
        fwht_from2(x, d);
        for (int j = 0; j < d; j++) x[j] *= f * signs[j];
        store_vec(x, dtype, d, dst + v * (Py_ssize_t)d * elem);
    }
    return 0;
}

static int check_args(int dtype, int d, int bits) {
    if (dtype < 1 || dtype > 3) {
        PyErr_Format(PyExc_ValueError, "rq: unknown dtype code %d", dtype);
        return 0;
    }
#ifndef __FLT16_MAX__
    if (dtype == 2) {
        PyErr_SetString(PyExc_NotImplementedError, "rq: fp16 needs a compiler with _Float16");
        return 0;
    }
#endif
    if (d < 16 || d > MAX_DIM || (d & (d - 1))) {
        PyErr_Format(PyExc_ValueError, "rq: head_dim %d is not a power of two in 16..%d", d, MAX_DIM);
        return 0;
    }
    if (bits != 3 && bits != 4) {
        PyErr_Format(PyExc_ValueError, "rq: bits %d is not 3 or 4", bits);
        return 0;
    }
    return 1;
}

static PyObject *rq_encode(PyObject *self, PyObject *args) {
    Py_buffer src, scales, codes;
    int dtype, d, bits;
    unsigned int seed;
    if (!PyArg_ParseTuple(args, "y*iiiIw*w*", &src, &dtype, &d, &bits, &seed, &scales, &codes)) return NULL;
    PyObject *result = NULL;
    if (!check_args(dtype, d, bits)) goto done;
    const int elem = dtype == 3 ? 4 : 2;
    const Py_ssize_t vec_bytes = (Py_ssize_t)d * elem;
    if (src.len % vec_bytes) {
        PyErr_Format(PyExc_ValueError, "rq: %zd bytes is not a whole number of %d-element vectors", src.len, d);
        goto done;
    }
    const Py_ssize_t n = src.len / vec_bytes;
    if (scales.len < n * 2 || codes.len < n * d * bits / 8) {
        PyErr_SetString(PyExc_ValueError, "rq: output buffers too small");
        goto done;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = encode_loop((const char *)src.buf, n, dtype, d, bits, seed, (uint16_t *)scales.buf, (uint8_t *)codes.buf);
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(rc == 0);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&scales);
    PyBuffer_Release(&codes);
    return result;
}

static PyObject *rq_decode(PyObject *self, PyObject *args) {
    Py_buffer scales, codes, dst;
    int dtype, d, bits;
    unsigned int seed;
    if (!PyArg_ParseTuple(args, "y*y*iiiIw*", &scales, &codes, &dtype, &d, &bits, &seed, &dst)) return NULL;
    PyObject *result = NULL;
    if (!check_args(dtype, d, bits)) goto done;
    const int elem = dtype == 3 ? 4 : 2;
    const Py_ssize_t vec_bytes = (Py_ssize_t)d * elem;
    if (dst.len % vec_bytes) {
        PyErr_Format(PyExc_ValueError, "rq: %zd bytes is not a whole number of %d-element vectors", dst.len, d);
        goto done;
    }
    const Py_ssize_t n = dst.len / vec_bytes;
    if (scales.len != n * 2 || codes.len != n * d * bits / 8) {
        PyErr_SetString(PyExc_ValueError, "rq: scales or codes do not match the output length");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    decode_loop((const uint16_t *)scales.buf, (const uint8_t *)codes.buf, n, dtype, d, bits, seed, (char *)dst.buf);
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyBuffer_Release(&scales);
    PyBuffer_Release(&codes);
    PyBuffer_Release(&dst);
    return result;
}

static PyMethodDef methods[] = {
    {"encode", rq_encode, METH_VARARGS, "encode(src, dtype, head_dim, bits, seed, scales_out, codes_out) -> bool"},
    {"decode", rq_decode, METH_VARARGS, "decode(scales, codes, dtype, head_dim, bits, seed, dst) -> None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rq", "Rotation quantizer loops (see rq.py).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__rq(void) { return PyModule_Create(&module); }
