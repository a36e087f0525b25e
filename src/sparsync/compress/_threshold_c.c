/* DCT-DP's mask pass in C (compress/threshold.py says when it is used): the positions of |v| >= tau (|v| > 0
   when tau = 0), ascending, in one pass that writes nothing but the positions. The same positions as the
   torch pass (abs, compare, nonzero) for every input, NaN included (a NaN compares false in both). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define TILE 4096 /* values whose comparison flags are made in one vectorized pass, then scanned 8 at a time */

#define SELECT(T, ABS)                                                                                         \
    static int64_t select_##T(const T *v, int64_t n, T tau, int64_t offset, int64_t *out) {                   \
        uint8_t flags[TILE];                                                                                   \
        int64_t k = 0;                                                                                         \
        for (int64_t t0 = 0; t0 < n; t0 += TILE) {                                                             \
            int64_t m = n - t0 < TILE ? n - t0 : TILE;                                                         \
            const T *x = v + t0;                                                                               \
            if (tau > 0)                                                                                       \
                for (int64_t i = 0; i < m; i++)                                                                \
                    flags[i] = ABS(x[i]) >= tau;                                                               \
            else                                                                                               \
                for (int64_t i = 0; i < m; i++)                                                                \
                    flags[i] = ABS(x[i]) > 0;                                                                  \
            for (int64_t i = m; i < ((m + 7) & ~7); i++)                                                       \
                flags[i] = 0;                                                                                  \
            for (int64_t i = 0; i < m; i += 8) {                                                               \
                uint64_t word;                                                                                 \
                memcpy(&word, flags + i, 8);                                                                   \
                for (; word; word &= word - 1) /* one byte of value 1 per selected entry */                    \
                    out[k++] = offset + t0 + i + (__builtin_ctzll(word) >> 3);                                 \
            }                                                                                                  \
        }                                                                                                      \
        return k;                                                                                              \
    }
SELECT(float, fabsf)
SELECT(double, fabs)

/* select(values, n, tau, offset, out, is_double) -> count: out[0..count) = offset + positions */
static PyObject *py_select(PyObject *self, PyObject *args) {
    unsigned long long v, out;
    long long n, offset;
    double tau;
    int dbl;
    if (!PyArg_ParseTuple(args, "KLdLKi", &v, &n, &tau, &offset, &out, &dbl))
        return NULL;
    if (n < 0)
        return PyErr_Format(PyExc_ValueError, "select: bad n=%lld", n);
    int64_t k;
    Py_BEGIN_ALLOW_THREADS
    k = dbl ? select_double((const double *)v, n, tau, offset, (int64_t *)out)
            : select_float((const float *)v, n, (float)tau, offset, (int64_t *)out);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(k);
}

static PyMethodDef methods[] = {
    {"select", py_select, METH_VARARGS, "select(values, n, tau, offset, out, is_double) -> count"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_threshold_c", "DCT-DP's mask pass in C.", -1, methods};

PyMODINIT_FUNC PyInit__threshold_c(void) { return PyModule_Create(&module); }
