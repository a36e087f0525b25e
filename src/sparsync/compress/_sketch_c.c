/* The S2 sketch's insert and query kernels in C (compress/sketch_hash.py says when they are used).

   The same hash as sketch_hash.Hasher: z = a_j·key + b_j mod 2^64, bucket = ⌊c·(bits 32..62 of z)/2^31⌋,
   sign = bit 63 (a flip of the value's sign bit). Insert adds every value to its cells in the order the torch
   kernel's index_add_ does (row by row, key by key), so the table holds the same sums; query reads the r
   estimates of each value and takes their median by sorting r <= 8 values (for even r the mean of the middle
   two, in the table's type), as median_rows does. One pass over the keys per row instead of a dozen tensor
   passes. float32 and float64 tables. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_ROWS 64
#define TILE 256 /* a block's values per pass of query_blocks */
#define MIN(x, y) ((y) < (x) ? (y) : (x))
#define MAX(x, y) ((x) < (y) ? (y) : (x))

enum { KEYS = 0, START = 1, RUN = 2 }; /* how a call names its keys (sketch_hash.Index) */

static inline uint64_t key_at(int mode, const int64_t *keys, int64_t start, int64_t width, int64_t i) {
    if (mode == KEYS)
        return (uint64_t)keys[i];
    if (mode == START)
        return (uint64_t)(start + i);
    return (uint64_t)(keys[i / width] * width + i % width);
}

static inline uint64_t bucket_of(uint64_t z, uint64_t c) { return (((z >> 32) & 0x7FFFFFFFu) * c) >> 31; }

#define SKETCH_KERNELS(T, U, SIGN)                                                                             \
    static inline T flip_##T(T v, uint64_t z) {                                                                \
        U u;                                                                                                   \
        memcpy(&u, &v, sizeof u);                                                                              \
        u ^= (U)((z >> 63) * (SIGN));                                                                          \
        memcpy(&v, &u, sizeof v);                                                                              \
        return v;                                                                                              \
    }                                                                                                          \
    /* median of e[0..r) (destroys e): for r = 3 the middle of three by min/max, else an odd-even            \
       transposition sort by min/max (branch-free: random estimates would mispredict every compare) */         \
    static inline T median_##T(T *e, int r) {                                                                  \
        if (r == 3) {                                                                                          \
            T lo = MIN(e[0], e[1]), hi = MAX(e[0], e[1]);                                                      \
            hi = MIN(hi, e[2]);                                                                                \
            return MAX(lo, hi);                                                                                \
        }                                                                                                      \
        for (int rnd = 0; rnd < r; rnd++)                                                                      \
            for (int i = rnd & 1; i + 1 < r; i += 2) {                                                         \
                T x = e[i], y = e[i + 1];                                                                      \
                e[i] = MIN(x, y);                                                                              \
                e[i + 1] = MAX(x, y);                                                                          \
            }                                                                                                  \
        return r % 2 ? e[r / 2] : (e[r / 2 - 1] + e[r / 2]) * (T)0.5;                                          \
    }                                                                                                          \
    static void insert_##T(T *table, int rows, uint64_t c, const int64_t *ab, int mode, const int64_t *keys,     \
                           int64_t start, int64_t width, const T *vals, int64_t k) {                           \
        for (int j = 0; j < rows; j++) {                                                                       \
            uint64_t a = (uint64_t)ab[2 * j], b = (uint64_t)ab[2 * j + 1];                                     \
            T *row = table + (uint64_t)j * c;                                                                  \
            for (int64_t i = 0; i < k; i++) {                                                                  \
                uint64_t z = a * key_at(mode, keys, start, width, i) + b;                                      \
                row[bucket_of(z, c)] += flip_##T(vals[i], z);                                                  \
            }                                                                                                  \
        }                                                                                                      \
    }                                                                                                          \
    static void query_##T(const T *table, int rows, uint64_t c, const int64_t *ab, int mode,                   \
                          const int64_t *keys, int64_t start, int64_t width, T *out, int64_t k) {              \
        T e[MAX_ROWS];                                                                                         \
        for (int64_t i = 0; i < k; i++) {                                                                      \
            uint64_t key = key_at(mode, keys, start, width, i);                                                \
            for (int j = 0; j < rows; j++) {                                                                   \
                uint64_t z = (uint64_t)ab[2 * j] * key + (uint64_t)ab[2 * j + 1];                              \
                e[j] = flip_##T(table[(uint64_t)j * c + bucket_of(z, c)], z);                                  \
            }                                                                                                  \
            out[i] = median_##T(e, rows);                                                                      \
        }                                                                                                      \
    }                                                                                                          \
    /* block hash: c buckets of b cells; block i's b values go to bucket h_j(blocks[i]) */                    \
    static void insert_blocks_##T(T *table, int rows, uint64_t c, const int64_t *ab, const int64_t *blocks,     \
                                  int64_t m, int64_t b, const T *vals) {                                       \
        for (int j = 0; j < rows; j++) {                                                                       \
            uint64_t a = (uint64_t)ab[2 * j], bb = (uint64_t)ab[2 * j + 1];                                    \
            T *row = table + (uint64_t)j * c * (uint64_t)b;                                                    \
            for (int64_t i = 0; i < m; i++) {                                                                  \
                uint64_t z = a * (uint64_t)blocks[i] + bb;                                                     \
                T *cell = row + bucket_of(z, c) * (uint64_t)b;                                                 \
                const T *v = vals + i * b;                                                                     \
                U s = (U)((z >> 63) * (SIGN));                                                                 \
                for (int64_t t = 0; t < b; t++) {                                                              \
                    U u;                                                                                       \
                    T w;                                                                                       \
                    memcpy(&u, v + t, sizeof u);                                                               \
                    u ^= s;                                                                                    \
                    memcpy(&w, &u, sizeof w);                                                                  \
                    cell[t] += w;                                                                              \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
    }                                                                                                          \
    static void query_blocks_##T(const T *table, int rows, uint64_t c, const int64_t *ab, const int64_t *blocks, \
                                 int64_t m, int64_t b, T *out) {                                               \
        T est[MAX_ROWS * TILE];                                                                                \
        T e[MAX_ROWS];                                                                                         \
        for (int64_t i = 0; i < m; i++) {                                                                      \
            for (int64_t t0 = 0; t0 < b; t0 += TILE) {                                                         \
                int64_t n = b - t0 < TILE ? b - t0 : TILE;                                                     \
                for (int j = 0; j < rows; j++) { /* row j's signed cells of this block, a tile at a time */    \
                    uint64_t z = (uint64_t)ab[2 * j] * (uint64_t)blocks[i] + (uint64_t)ab[2 * j + 1];          \
                    const T *cell = table + ((uint64_t)j * c + bucket_of(z, c)) * (uint64_t)b + t0;            \
                    U s = (U)((z >> 63) * (SIGN));                                                             \
                    T *dst = est + j * TILE;                                                                   \
                    for (int64_t t = 0; t < n; t++) {                                                          \
                        U u;                                                                                   \
                        memcpy(&u, cell + t, sizeof u);                                                        \
                        u ^= s;                                                                                \
                        memcpy(dst + t, &u, sizeof u);                                                         \
                    }                                                                                          \
                }                                                                                              \
                T *o = out + i * b + t0;                                                                       \
                if (rows == 3) { /* vectorized over the tile */                                                \
                    const T *e0 = est, *e1 = est + TILE, *e2 = est + 2 * TILE;                                 \
                    for (int64_t t = 0; t < n; t++) {                                                          \
                        T lo = MIN(e0[t], e1[t]), hi = MAX(e0[t], e1[t]);                                      \
                        hi = MIN(hi, e2[t]);                                                                   \
                        o[t] = MAX(lo, hi);                                                                    \
                    }                                                                                          \
                } else {                                                                                       \
                    for (int64_t t = 0; t < n; t++) {                                                          \
                        for (int j = 0; j < rows; j++)                                                         \
                            e[j] = est[j * TILE + t];                                                          \
                        o[t] = median_##T(e, rows);                                                            \
                    }                                                                                          \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
    }

SKETCH_KERNELS(float, uint32_t, 0x80000000u)
SKETCH_KERNELS(double, uint64_t, 0x8000000000000000ull)

/* --- Python bindings: pointers as ints (tensor.data_ptr()), checked by the caller (sketch_hash.py) ---- */

static int check_common(int rows, long long c, int is_double) {
    if (rows < 1 || rows > MAX_ROWS || c < 1 || c >= (1LL << 32) || (is_double != 0 && is_double != 1)) {
        PyErr_Format(PyExc_ValueError, "sketch kernel: bad table (rows=%d, buckets=%lld)", rows, c);
        return 0;
    }
    return 1;
}

/* insert(table, rows, c, ab, mode, keys, start, width, vals, k, is_double) and query(..., out, k, is_double) */
static PyObject *keys_call(PyObject *args, int query) {
    unsigned long long table, ab, keys, vals;
    long long c, start, width, k;
    int rows, mode, dbl;
    if (!PyArg_ParseTuple(args, "KiLKiKLLKLi", &table, &rows, &c, &ab, &mode, &keys, &start, &width, &vals, &k,
                          &dbl))
        return NULL;
    if (!check_common(rows, c, dbl) || mode < KEYS || mode > RUN || k < 0 || (mode == RUN && width < 1))
        return PyErr_Occurred() ? NULL : PyErr_Format(PyExc_ValueError, "keys: bad keys (mode=%d)", mode);
    const int64_t *kp = (const int64_t *)keys, *abp = (const int64_t *)ab;
    Py_BEGIN_ALLOW_THREADS
    if (query && dbl)
        query_double((const double *)table, rows, (uint64_t)c, abp, mode, kp, start, width, (double *)vals, k);
    else if (query)
        query_float((const float *)table, rows, (uint64_t)c, abp, mode, kp, start, width, (float *)vals, k);
    else if (dbl)
        insert_double((double *)table, rows, (uint64_t)c, abp, mode, kp, start, width, (const double *)vals, k);
    else
        insert_float((float *)table, rows, (uint64_t)c, abp, mode, kp, start, width, (const float *)vals, k);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_insert(PyObject *self, PyObject *args) { return keys_call(args, 0); }
static PyObject *py_query(PyObject *self, PyObject *args) { return keys_call(args, 1); }

/* insert_blocks(table, rows, c, ab, blocks, m, b, vals, is_double) and query_blocks(..., out, is_double) */
static PyObject *blocks_call(PyObject *args, int query) {
    unsigned long long table, ab, blocks, vals;
    long long c, m, b;
    int rows, dbl;
    if (!PyArg_ParseTuple(args, "KiLKKLLKi", &table, &rows, &c, &ab, &blocks, &m, &b, &vals, &dbl))
        return NULL;
    if (!check_common(rows, c, dbl) || m < 0 || b < 1)
        return PyErr_Occurred() ? NULL : PyErr_Format(PyExc_ValueError, "blocks: bad sizes (m=%lld b=%lld)", m, b);
    Py_BEGIN_ALLOW_THREADS
    if (query && dbl)
        query_blocks_double((const double *)table, rows, (uint64_t)c, (const int64_t *)ab, (const int64_t *)blocks, m,
                            b, (double *)vals);
    else if (query)
        query_blocks_float((const float *)table, rows, (uint64_t)c, (const int64_t *)ab, (const int64_t *)blocks, m, b,
                           (float *)vals);
    else if (dbl)
        insert_blocks_double((double *)table, rows, (uint64_t)c, (const int64_t *)ab, (const int64_t *)blocks, m, b,
                             (const double *)vals);
    else
        insert_blocks_float((float *)table, rows, (uint64_t)c, (const int64_t *)ab, (const int64_t *)blocks, m, b,
                            (const float *)vals);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_insert_blocks(PyObject *self, PyObject *args) { return blocks_call(args, 0); }
static PyObject *py_query_blocks(PyObject *self, PyObject *args) { return blocks_call(args, 1); }

static PyMethodDef methods[] = {
    {"insert", py_insert, METH_VARARGS, "insert(table, rows, c, ab, mode, keys, start, width, vals, k, is_double)"},
    {"query", py_query, METH_VARARGS, "query(table, rows, c, ab, mode, keys, start, width, out, k, is_double)"},
    {"insert_blocks", py_insert_blocks, METH_VARARGS, "insert_blocks(table, rows, c, ab, blocks, m, b, vals, is_double)"},
    {"query_blocks", py_query_blocks, METH_VARARGS, "query_blocks(table, rows, c, ab, blocks, m, b, out, is_double)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sketch_c", "S2 sketch kernels in C (sketch_hash.py).",
                                    -1, methods};

PyMODINIT_FUNC PyInit__sketch_c(void) { return PyModule_Create(&module); }
