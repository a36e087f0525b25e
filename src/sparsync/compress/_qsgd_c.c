/* QSGD's encode and decode-sum kernels in C (compress/qsgd_kernels.py says when they are used).

   Bit for bit what the torch kernels of qsgd.py compute for finite inputs, one fused pass per bucket instead
   of a dozen tensor passes: the same float32 operations in the same order, compiled with
   -ffp-contract=off so that no multiply-add is fused. Non-finite inputs give a NaN or infinite scale, as in
   torch; their codes may differ (torch's float -> int conversion of NaN is undefined, here it gives 0).

   Rounding noise: value i of a call takes the 16 bits at 16·(i mod 4) of splitmix64's output function of
   seed + (⌊i/4⌋ + 1)·γ (a counter-based stream: any range can be computed independently, and the torch
   reference computes the same words with int64 tensor arithmetic). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define GAMMA 0x9E3779B97F4A7C15ULL
#define TILE 4096 /* values whose noise and codes are made in one go (L1-resident scratch) */

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* codes[i] (one byte each, 0..2s) of x[lo, hi), one bucket of inverse step inv; noise words from the call's
   value 0 on. */
CLONES static void round_bucket(const float *x, int64_t lo, int64_t hi, float inv, float c, float top,
                                uint64_t seed, uint8_t *codes) {
    int16_t noise[TILE + 8];
    for (int64_t t0 = lo; t0 < hi; t0 += TILE) {
        int64_t t1 = t0 + TILE < hi ? t0 + TILE : hi;
        int64_t w0 = t0 >> 2, w1 = (t1 + 3) >> 2;
        for (int64_t w = w0; w < w1; w++) {
            uint64_t z = mix64(seed + (uint64_t)(w + 1) * GAMMA);
            memcpy(noise + 4 * (w - w0), &z, 8); /* little-endian: lane j is bits 16j..16j+15 */
        }
        const int16_t *r = noise + (t0 - 4 * w0);
        for (int64_t i = t0; i < t1; i++) {
            float t = (float)r[i - t0] * 0x1p-16f + c;
            t = t + x[i] * inv;
            t = t > 0.0f ? t : 0.0f; /* NaN -> 0 */
            t = t < top ? t : top;
            codes[i] = (uint8_t)(int32_t)t;
        }
    }
}

/* max |x| over x[lo, hi), NaN if any is: on the bits of |x| (sign cleared) float order is integer order, and
   every NaN pattern is above +inf's. */
CLONES static float bucket_max(const float *x, int64_t lo, int64_t hi) {
    uint32_t m = 0;
    for (int64_t i = lo; i < hi; i++) {
        uint32_t u;
        memcpy(&u, x + i, 4);
        u &= 0x7FFFFFFFu;
        m = u > m ? u : m;
    }
    float f;
    memcpy(&f, &m, 4);
    return f;
}

/* k values of x (buckets of B, the last one may be partial) -> scales (one per bucket) and packed codes
   (8 / bits per byte, the first in the low bits); tmp: k bytes of scratch. */
static void encode(const float *x, int64_t k, int64_t B, int bits, uint64_t seed, float *scales, uint8_t *out,
                   uint8_t *tmp) {
    const int s = (1 << (bits - 1)) - 1;
    const float fs = (float)s, top = (float)(2 * s), c = fs + 0.5f + 0x1p-17f;
    for (int64_t lo = 0; lo < k; lo += B) {
        int64_t hi = lo + B < k ? lo + B : k;
        float S = bucket_max(x, lo, hi);
        scales[lo / B] = S;
        float inv = S > 0.0f ? (1.0f / S) * fs : 0.0f; /* torch: s / S is S.reciprocal() * s */
        round_bucket(x, lo, hi, inv, c, top, seed, bits == 8 ? out : tmp);
    }
    if (bits == 4) {
        int64_t m = k / 2;
        for (int64_t j = 0; j < m; j++)
            out[j] = (uint8_t)(tmp[2 * j] | (tmp[2 * j + 1] << 4));
        if (k & 1)
            out[m] = tmp[k - 1];
    } else if (bits == 2) {
        int64_t m = k / 4;
        for (int64_t j = 0; j < m; j++)
            out[j] = (uint8_t)(tmp[4 * j] | (tmp[4 * j + 1] << 2) | (tmp[4 * j + 2] << 4) | (tmp[4 * j + 3] << 6));
        if (k & 3) {
            uint8_t b = 0;
            for (int64_t i = 4 * m; i < k; i++)
                b |= (uint8_t)(tmp[i] << (2 * (i - 4 * m)));
            out[m] = b;
        }
    }
}

/* out[i] = v, first[i] + v, or out[i] + v (mode 0, 1, 2) with v = (code_i - s)·step, for the codes of m whole
   bytes (8 / bits values each, the first in the low bits); bits and mode constants at every call site. */
static inline __attribute__((always_inline)) void decode_bytes(const uint8_t *restrict c, int64_t m, int bits,
                                                               int mode, float step, float fs,
                                                               const float *restrict first, float *restrict out) {
    const int per = 8 / bits;
    const unsigned mask = (1u << bits) - 1;
    for (int64_t j = 0; j < m; j++) {
        unsigned byte = c[j];
        for (int t = 0; t < per; t++) {
            float v = ((float)((byte >> (t * bits)) & mask) - fs) * step;
            int64_t i = j * per + t;
            out[i] = mode == 0 ? v : (mode == 1 ? first[i] : out[i]) + v;
        }
    }
}

/* One bucket's values [lo, hi) of one payload (module doc of decode_sum): whole bytes by decode_bytes, a
   partial last byte (or a bucket that does not start on a byte) value by value. */
CLONES static void decode_bucket(const uint8_t *codes, int64_t lo, int64_t hi, int bits, int mode, float step,
                                 float fs, const float *first, float *out) {
    const int per = 8 / bits;
    const unsigned mask = (1u << bits) - 1;
    int64_t i = lo;
    if (lo % per == 0) {
        int64_t m = (hi - lo) / per;
        const uint8_t *c = codes + lo / per;
        const float *f = first ? first + lo : NULL;
        float *o = out + lo;
#define RUN(BITS, MODE) decode_bytes(c, m, BITS, MODE, step, fs, f, o)
        switch (bits * 4 + mode) {
        case 32: RUN(8, 0); break;
        case 33: RUN(8, 1); break;
        case 34: RUN(8, 2); break;
        case 16: RUN(4, 0); break;
        case 17: RUN(4, 1); break;
        case 18: RUN(4, 2); break;
        case 8: RUN(2, 0); break;
        case 9: RUN(2, 1); break;
        default: RUN(2, 2); break;
        }
#undef RUN
        i = lo + m * per;
    }
    for (; i < hi; i++) {
        float v = ((float)((codes[i / per] >> ((i % per) * bits)) & mask) - fs) * step;
        out[i] = mode == 0 ? v : (mode == 1 ? first[i] : out[i]) + v;
    }
}

/* out = first + Σ_p decode(p) over k values (first may be NULL), bucket by bucket so the bucket's outputs stay
   in L1 while every payload is added to them in order: per value the same sums as torch's one pass per
   payload. */
static void decode_sum(int np, uint8_t *const *codes, float *const *scales, const float *first, int64_t k,
                       int64_t B, int bits, float *out) {
    const int s = (1 << (bits - 1)) - 1;
    const float fs = (float)s;
    for (int64_t lo = 0; lo < k; lo += B) {
        int64_t hi = lo + B < k ? lo + B : k;
        for (int p = 0; p < np; p++) {
            float step = scales[p][lo / B] / fs;
            int mode = p > 0 ? 2 : (first ? 1 : 0);
            decode_bucket(codes[p], lo, hi, bits, mode, step, fs, first, out);
        }
    }
}

/* --- Python bindings: pointers as ints (tensor.data_ptr()), checked by the caller (qsgd_kernels.py) ---- */

static PyObject *py_encode(PyObject *self, PyObject *args) {
    unsigned long long x, scales, out, tmp, seed;
    long long k, B;
    int bits;
    if (!PyArg_ParseTuple(args, "KLLiKKKK", &x, &k, &B, &bits, &seed, &scales, &out, &tmp))
        return NULL;
    if (k < 0 || B <= 0 || (bits != 2 && bits != 4 && bits != 8)) {
        PyErr_Format(PyExc_ValueError, "encode: bad sizes k=%lld B=%lld bits=%d", k, B, bits);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    encode((const float *)x, k, B, bits, (uint64_t)seed, (float *)scales, (uint8_t *)out, (uint8_t *)tmp);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_decode_sum(PyObject *self, PyObject *args) {
    PyObject *codes_list, *scales_list;
    unsigned long long first, out;
    long long k, B;
    int bits;
    if (!PyArg_ParseTuple(args, "O!O!KLLiK", &PyList_Type, &codes_list, &PyList_Type, &scales_list, &first, &k,
                          &B, &bits, &out))
        return NULL;
    Py_ssize_t np = PyList_Size(codes_list);
    if (np < 1 || np > 4096 || PyList_Size(scales_list) != np || k < 0 || B <= 0 ||
        (bits != 2 && bits != 4 && bits != 8)) {
        PyErr_Format(PyExc_ValueError, "decode_sum: bad arguments (payloads=%zd k=%lld B=%lld bits=%d)", np, k, B,
                     bits);
        return NULL;
    }
    uint8_t *cp[4096];
    float *sp[4096];
    for (Py_ssize_t p = 0; p < np; p++) {
        cp[p] = (uint8_t *)PyLong_AsUnsignedLongLong(PyList_GET_ITEM(codes_list, p));
        sp[p] = (float *)PyLong_AsUnsignedLongLong(PyList_GET_ITEM(scales_list, p));
    }
    if (PyErr_Occurred())
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    decode_sum((int)np, cp, sp, (const float *)first, k, B, bits, (float *)out);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"encode", py_encode, METH_VARARGS,
     "encode(x, k, bucket, bits, seed, scales, codes, scratch): QSGD codes and scales of k float32 values."},
    {"decode_sum", py_decode_sum, METH_VARARGS,
     "decode_sum(codes, scales, first, k, bucket, bits, out): out = first + sum of the decoded payloads."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_qsgd_c", "QSGD kernels in C (qsgd_kernels.py).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__qsgd_c(void) { return PyModule_Create(&module); }
