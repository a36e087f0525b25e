/* A table group's step kernels in C (sharding/kernels.py says when each is used). Each gives the same bits as
   the torch ops it stands for, for every input:
   - unique: torch.unique(sorted=True, return_inverse=True) of int64 keys (an LSD radix sort, 11-bit digits);
   - gather: index_select(0, rows) of a [R, D] tensor (row copies, rows ahead prefetched);
   - scatter_add: index_select's backward, index_add_ into zeros: each row's sources summed in their order,
     0 + a + b + ..., as torch's CPU scatter-add sums them;
   - sum_rows: coalesce's sum of a sparse tensor's rows (a row's values copied, then added) where no row occurs
     more than twice (then the order of the sum does not change its bits);
   - update: fused.py's steps over distinct rows: index_put_'s accumulate (t + v), Adagrad's sum of squares
     (t + v * v) and the step w + (g / std) * (-lr) (w + g * (-lr) for SGD), each element the expressions of
     the torch ops in the tensor's precision. The square root stays torch's: its CPU kernel is not always
     correctly rounded, so no C expression matches it everywhere.
   Row indices are checked before anything is written: a bad one is reported, nothing is changed. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BITS 11
#define BUCKETS (1 << BITS)
#define SIGN 0x8000000000000000ULL

/* the first of rows[0..n) outside [0, limit), or -1 when all are inside */
static int64_t bad_row(const int64_t *rows, int64_t n, int64_t limit) {
    for (int64_t i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= limit)
            return i;
    return -1;
}

/* one stable LSD pass per BITS-bit digit of bits [shift, shift + BITS * passes) of ka: ka (with pa, when given)
   sorted into kb (pb) and back, ping-pong; returns the buffer holding the result (*pa_out: its positions) */
static uint64_t *radix(uint64_t *ka, uint64_t *kb, int64_t *pa, int64_t *pb, int64_t n, int shift, int passes,
                       uint64_t *hist, int64_t **pa_out) {
    for (int64_t i = 0; i < n; i++)
        for (int d = 0; d < passes; d++)
            hist[d * BUCKETS + ((ka[i] >> (shift + d * BITS)) & (BUCKETS - 1))]++;
    for (int d = 0; d < passes; d++) {
        uint64_t *h = hist + d * BUCKETS, sum = 0;
        int at_shift = shift + d * BITS;
        for (int b = 0; b < BUCKETS; b++) {
            uint64_t c = h[b];
            h[b] = sum, sum += c;
        }
        if (pa)
            for (int64_t i = 0; i < n; i++) {
                uint64_t at = h[(ka[i] >> at_shift) & (BUCKETS - 1)]++;
                kb[at] = ka[i], pb[at] = pa[i];
            }
        else
            for (int64_t i = 0; i < n; i++)
                kb[h[(ka[i] >> at_shift) & (BUCKETS - 1)]++] = ka[i];
        uint64_t *kt = ka;
        int64_t *pt = pa;
        ka = kb, kb = kt, pa = pb, pb = pt;
    }
    *pa_out = pa;
    return ka;
}

static int bit_length(uint64_t x) {
    int b = 0;
    for (; x; x >>= 1)
        b++;
    return b;
}

/* keys[0..n) -> out[0..count) ascending distinct, inverse[i] = position of keys[i] in out; -1: no memory. The
   keys as unsigned (sign bit flipped: the same order) less the least; when that and the position fit in 64
   bits, both travel in one word (key above, position below) and only the key's digits are sorted. */
static int64_t unique(const int64_t *keys, int64_t n, int64_t *out, int64_t *inverse) {
    if (n == 0)
        return 0;
    uint64_t lo = UINT64_MAX, hi = 0;
    for (int64_t i = 0; i < n; i++) {
        uint64_t u = (uint64_t)keys[i] ^ SIGN;
        lo = u < lo ? u : lo;
        hi = u > hi ? u : hi;
    }
    int key_bits = bit_length(hi - lo), pos_bits = bit_length((uint64_t)n - 1);
    int packed = key_bits + pos_bits <= 64, passes = (key_bits + BITS - 1) / BITS;
    uint64_t *k = malloc(2 * (size_t)n * sizeof(uint64_t));
    int64_t *p = packed ? NULL : malloc(2 * (size_t)n * sizeof(int64_t));
    uint64_t *hist = calloc((size_t)(passes ? passes : 1) * BUCKETS, sizeof(uint64_t));
    if (!k || (!packed && !p) || !hist) {
        free(k), free(p), free(hist);
        return -1;
    }
    uint64_t mask = pos_bits ? UINT64_MAX >> (64 - pos_bits) : 0;
    for (int64_t i = 0; i < n; i++) {
        uint64_t u = ((uint64_t)keys[i] ^ SIGN) - lo;
        if (packed)
            k[i] = pos_bits ? (u << pos_bits) | (uint64_t)i : u;
        else
            k[i] = u, p[i] = i;
    }
    int64_t *pos;
    uint64_t *sorted = radix(k, k + n, p, p ? p + n : NULL, n, packed ? pos_bits : 0, passes, hist, &pos);
    int64_t count = 0;
    uint64_t last = 0;
    for (int64_t i = 0; i < n; i++) {
        uint64_t key = packed ? (pos_bits ? sorted[i] >> pos_bits : sorted[i]) : sorted[i];
        if (i == 0 || key != last)
            out[count++] = (int64_t)((key + lo) ^ SIGN), last = key;
        inverse[packed ? (int64_t)(sorted[i] & mask) : pos[i]] = count - 1;
    }
    free(k), free(p), free(hist);
    return count;
}

#define AHEAD 16 /* rows ahead whose first cache line is prefetched: the rows are scattered over a large table */

static void gather(const char *src, const int64_t *rows, int64_t n, size_t row_bytes, char *out) {
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n)
            __builtin_prefetch(src + (size_t)rows[i + AHEAD] * row_bytes);
        memcpy(out + (size_t)i * row_bytes, src + (size_t)rows[i] * row_bytes, row_bytes);
    }
}

#define KERNELS(T)                                                                                       \
    static void scatter_add_##T(const T *src, const int64_t *index, int64_t n, int64_t D, T *out, int64_t m) { \
        memset(out, 0, (size_t)m * (size_t)D * sizeof(T));                                                     \
        for (int64_t i = 0; i < n; i++) {                                                                      \
            T *o = out + index[i] * D;                                                                         \
            const T *s = src + i * D;                                                                          \
            for (int64_t d = 0; d < D; d++)                                                                    \
                o[d] = o[d] + s[d];                                                                            \
        }                                                                                                      \
    }                                                                                                          \
    /* out[u] = the sum of the rows v_i with inverse[i] = u, the first copied, the others added in order;        \
       returns the most rows summed into one */                                                                \
    static int64_t sum_rows_##T(const T *v, const int64_t *inverse, int64_t n, int64_t D, T *out,              \
                                int64_t *seen) {                                                               \
        int64_t most = 0;                                                                                      \
        for (int64_t i = 0; i < n; i++) {                                                                      \
            int64_t u = inverse[i];                                                                            \
            T *o = out + u * D;                                                                                \
            const T *s = v + i * D;                                                                            \
            if (seen[u]++)                                                                                     \
                for (int64_t d = 0; d < D; d++)                                                                \
                    o[d] = o[d] + s[d];                                                                        \
            else                                                                                               \
                memcpy(o, s, (size_t)D * sizeof(T));                                                           \
            most = seen[u] > most ? seen[u] : most;                                                            \
        }                                                                                                      \
        return most;                                                                                           \
    }                                                                                                          \
    /* t_r = t_r + v (index_put_'s accumulate), or t_r = t_r + v * v (squares: v.pow(2) added) */            \
    static void add_##T(T *t, const int64_t *rows, int64_t n, int64_t D, const T *v, int squares) {            \
        for (int64_t i = 0; i < n; i++) {                                                                      \
            if (i + AHEAD < n)                                                                                 \
                __builtin_prefetch(t + rows[i + AHEAD] * D, 1);                                                \
            T *o = t + rows[i] * D;                                                                            \
            const T *s = v + i * D;                                                                            \
            if (squares)                                                                                       \
                for (int64_t d = 0; d < D; d++)                                                                \
                    o[d] = o[d] + s[d] * s[d];                                                                 \
            else                                                                                               \
                for (int64_t d = 0; d < D; d++)                                                                \
                    o[d] = o[d] + s[d];                                                                        \
        }                                                                                                      \
    }                                                                                                          \
    /* w_r = w_r + g * (-lr) without std; else w_r = w_r + (g / std) * (-lr), std per element (stride D) or    \
       per row (stride 1) */                                                                                   \
    static void step_##T(T *w, const int64_t *rows, int64_t n, int64_t D, const T *g, const T *std,            \
                         int64_t stride, T neg_lr) {                                                           \
        for (int64_t i = 0; i < n; i++) {                                                                      \
            if (i + AHEAD < n)                                                                                 \
                __builtin_prefetch(w + rows[i + AHEAD] * D, 1);                                                \
            T *o = w + rows[i] * D;                                                                            \
            const T *s = g + i * D;                                                                            \
            if (!std)                                                                                          \
                for (int64_t d = 0; d < D; d++)                                                                \
                    o[d] = o[d] + s[d] * neg_lr;                                                               \
            else if (stride == 1)                                                                              \
                for (int64_t d = 0; d < D; d++)                                                                \
                    o[d] = o[d] + (s[d] / std[i]) * neg_lr;                                                    \
            else                                                                                               \
                for (int64_t d = 0; d < D; d++)                                                                \
                    o[d] = o[d] + (s[d] / std[i * D + d]) * neg_lr;                                            \
        }                                                                                                      \
    }
KERNELS(float)
KERNELS(double)

static PyObject *bad_index(const char *name, const int64_t *rows, int64_t at, int64_t limit) {
    return PyErr_Format(PyExc_IndexError, "%s: row %lld at position %lld is out of range for %lld rows", name,
                        (long long)rows[at], (long long)at, (long long)limit);
}

/* unique(keys, n, out, inverse) -> count */
static PyObject *py_unique(PyObject *self, PyObject *args) {
    unsigned long long keys, out, inverse;
    long long n;
    if (!PyArg_ParseTuple(args, "KLKK", &keys, &n, &out, &inverse))
        return NULL;
    if (n < 0)
        return PyErr_Format(PyExc_ValueError, "unique: bad n=%lld", n);
    int64_t count;
    Py_BEGIN_ALLOW_THREADS
    count = unique((const int64_t *)keys, n, (int64_t *)out, (int64_t *)inverse);
    Py_END_ALLOW_THREADS
    if (count < 0)
        return PyErr_NoMemory();
    return PyLong_FromLongLong(count);
}

/* gather(src, limit, row_bytes, rows, n, out): out[i] = src[rows[i]], rows of row_bytes bytes */
static PyObject *py_gather(PyObject *self, PyObject *args) {
    unsigned long long src, rows, out;
    long long limit, row_bytes, n;
    if (!PyArg_ParseTuple(args, "KLLKLK", &src, &limit, &row_bytes, &rows, &n, &out))
        return NULL;
    if (n < 0 || limit < 0 || row_bytes < 0)
        return PyErr_Format(PyExc_ValueError, "gather: bad n=%lld, limit=%lld or row_bytes=%lld", n, limit,
                            row_bytes);
    int64_t at;
    Py_BEGIN_ALLOW_THREADS
    at = bad_row((const int64_t *)rows, n, limit);
    if (at < 0)
        gather((const char *)src, (const int64_t *)rows, n, (size_t)row_bytes, (char *)out);
    Py_END_ALLOW_THREADS
    if (at >= 0)
        return bad_index("gather", (const int64_t *)rows, at, limit);
    Py_RETURN_NONE;
}

/* scatter_add(src, index, n, D, out, m, is_double): out = zeros [m, D]; out[index[i]] += src[i] in order */
static PyObject *py_scatter_add(PyObject *self, PyObject *args) {
    unsigned long long src, index, out;
    long long n, D, m;
    int dbl;
    if (!PyArg_ParseTuple(args, "KKLLKLi", &src, &index, &n, &D, &out, &m, &dbl))
        return NULL;
    if (n < 0 || D < 0 || m < 0)
        return PyErr_Format(PyExc_ValueError, "scatter_add: bad n=%lld, D=%lld or m=%lld", n, D, m);
    int64_t at;
    Py_BEGIN_ALLOW_THREADS
    at = bad_row((const int64_t *)index, n, m);
    if (at < 0 && dbl)
        scatter_add_double((const double *)src, (const int64_t *)index, n, D, (double *)out, m);
    else if (at < 0)
        scatter_add_float((const float *)src, (const int64_t *)index, n, D, (float *)out, m);
    Py_END_ALLOW_THREADS
    if (at >= 0)
        return bad_index("scatter_add", (const int64_t *)index, at, m);
    Py_RETURN_NONE;
}

/* sum_rows(rows, n, values, D, out_rows, out, is_double) -> count, or -1 when a row occurs more than twice:
   out_rows[0..count) the distinct rows ascending, out[u] their values' sums, the first copied and the second
   added (a + b = b + a: the sum of at most two is the same bits in any order, coalesce's included) */
static PyObject *py_sum_rows(PyObject *self, PyObject *args) {
    unsigned long long rows, v, out_rows, out;
    long long n, D;
    int dbl;
    if (!PyArg_ParseTuple(args, "KLKLKKi", &rows, &n, &v, &D, &out_rows, &out, &dbl))
        return NULL;
    if (n < 0 || D < 0)
        return PyErr_Format(PyExc_ValueError, "sum_rows: bad n=%lld or D=%lld", n, D);
    int64_t count = 0, most = 0;
    Py_BEGIN_ALLOW_THREADS
    int64_t *inverse = malloc(((size_t)n + 1) * sizeof(int64_t)), *seen = calloc((size_t)n + 1, sizeof(int64_t));
    if (inverse && seen)
        count = unique((const int64_t *)rows, n, (int64_t *)out_rows, inverse);
    else
        count = -1;
    if (count >= 0 && dbl)
        most = sum_rows_double((const double *)v, inverse, n, D, (double *)out, seen);
    else if (count >= 0)
        most = sum_rows_float((const float *)v, inverse, n, D, (float *)out, seen);
    free(inverse), free(seen);
    Py_END_ALLOW_THREADS
    if (count < 0)
        return PyErr_NoMemory();
    return PyLong_FromLongLong(most > 2 ? -1 : count);
}

/* update(kind, t, R, D, rows, n, v, std, stride, lr, is_double): kind 0 add v, 1 add v * v, 2 the step (std 0:
   none; stride 1 or D) */
static PyObject *py_update(PyObject *self, PyObject *args) {
    unsigned long long t, rows, v, std;
    long long R, D, n, stride;
    double lr;
    int kind, dbl;
    if (!PyArg_ParseTuple(args, "iKLLKLKKLdi", &kind, &t, &R, &D, &rows, &n, &v, &std, &stride, &lr, &dbl))
        return NULL;
    if (n < 0 || D < 0 || R < 0 || kind < 0 || kind > 2 || (std && stride != 1 && stride != D))
        return PyErr_Format(PyExc_ValueError, "update: bad n=%lld, D=%lld, R=%lld, kind=%d or stride=%lld", n, D,
                            R, kind, stride);
    const int64_t *r = (const int64_t *)rows;
    int64_t at;
    Py_BEGIN_ALLOW_THREADS
    at = bad_row(r, n, R);
    if (at < 0 && dbl && kind < 2)
        add_double((double *)t, r, n, D, (const double *)v, kind);
    else if (at < 0 && dbl)
        step_double((double *)t, r, n, D, (const double *)v, (const double *)std, stride, -lr);
    else if (at < 0 && kind < 2)
        add_float((float *)t, r, n, D, (const float *)v, kind);
    else if (at < 0)
        step_float((float *)t, r, n, D, (const float *)v, (const float *)std, stride, (float)-lr);
    Py_END_ALLOW_THREADS
    if (at >= 0)
        return bad_index("update", r, at, R);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"unique", py_unique, METH_VARARGS, "unique(keys, n, out, inverse) -> count"},
    {"gather", py_gather, METH_VARARGS, "gather(src, limit, row_bytes, rows, n, out)"},
    {"scatter_add", py_scatter_add, METH_VARARGS, "scatter_add(src, index, n, D, out, m, is_double)"},
    {"sum_rows", py_sum_rows, METH_VARARGS, "sum_rows(rows, n, values, D, out_rows, out, is_double) -> count"},
    {"update", py_update, METH_VARARGS, "update(kind, t, R, D, rows, n, v, std, stride, lr, is_double)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_group_c", "A table group's step kernels in C.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__group_c(void) { return PyModule_Create(&module); }
