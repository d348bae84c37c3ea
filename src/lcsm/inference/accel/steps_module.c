/* The functions of steps.c as a CPython extension module, loaded by native.py where Python's headers are (else it
loads steps.c through ctypes). A call here skips ctypes' per-call work (argument conversion and
releasing the GIL), which costs more than a flash step's own arithmetic at D = 64.
Every argument is a Python int (an address, a size or a flag), in the order of the C function. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "steps.c"

static int int_args(PyObject *const *args, Py_ssize_t n, Py_ssize_t want, int64_t *out) {
  if (n != want) {
    PyErr_Format(PyExc_TypeError, "expected %zd int arguments, got %zd", want, n);
    return -1;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    out[i] = PyLong_AsLongLong(args[i]); /* addresses of user space fit in int64 */
    if (out[i] == -1 && PyErr_Occurred()) return -1;
  }
  return 0;
}

#define ARG(i, T) ((T)(intptr_t)a[i])

#define WRAP(NAME, N, CALL)                                                                                     \
  static PyObject *py_##NAME(PyObject *self, PyObject *const *args, Py_ssize_t n) {                             \
    (void)self;                                                                                                 \
    int64_t a[N];                                                                                               \
    if (int_args(args, n, N, a)) return NULL;                                                                   \
    CALL;                                                                                                       \
    Py_RETURN_NONE;                                                                                             \
  }

#define WRAP_INT(NAME, N, CALL)                                                                                 \
  static PyObject *py_##NAME(PyObject *self, PyObject *const *args, Py_ssize_t n) {                             \
    (void)self;                                                                                                 \
    int64_t a[N];                                                                                               \
    if (int_args(args, n, N, a)) return NULL;                                                                   \
    return PyLong_FromLong(CALL);                                                                               \
  }

#define WRAP_DTYPE(S, T)                                                                                        \
  WRAP(flash_step_##S, 4, flash_step_##S(ARG(0, flash_step_##S##_slot *), a[1], ARG(2, const T *), ARG(3, T *))) \
  WRAP(lazy_step_##S, 7, lazy_step_##S(ARG(0, T *), ARG(1, const T *), a[2], a[3], a[4], ARG(5, const T *),     \
                                       ARG(6, T *)))                                                            \
  WRAP(block_exit_##S, 6,                                                                                       \
       block_exit_##S(ARG(0, const block_exit_##S##_args *), ARG(1, const T *), ARG(2, const T *),              \
                      ARG(3, const T *), ARG(4, T *), ARG(5, T *)))                                          \
  WRAP_INT(decode_token_##S, 4,                                                                                 \
           decode_token_##S(ARG(0, decode_token_##S##_args *), a[1], ARG(2, const int64_t *), ARG(3, T *)))

WRAP_DTYPE(f32, float)
WRAP_DTYPE(f64, double)
WRAP(erf_f32_array, 3, erf_f32_array(ARG(0, const float *), ARG(1, float *), a[2]))

#define METHOD(NAME) {#NAME, (PyCFunction)(void (*)(void))py_##NAME, METH_FASTCALL, NULL}

static PyMethodDef methods[] = {
    METHOD(flash_step_f32), METHOD(lazy_step_f32), METHOD(block_exit_f32), METHOD(decode_token_f32),
    METHOD(flash_step_f64), METHOD(lazy_step_f64), METHOD(block_exit_f64), METHOD(decode_token_f64),
    METHOD(erf_f32_array),  {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_lcsm_steps", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__lcsm_steps(void) { return PyModule_Create(&module); }
