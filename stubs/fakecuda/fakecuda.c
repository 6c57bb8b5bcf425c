/* A fake libcuda.so.1 for tests: the real driver ABI, acting on the fake GPU ledger.
 *
 * The checkpoint functions call back into the Python process that loaded this library
 * (slicerd's checkpoint helper loads it with ctypes.CDLL): each takes the GIL and calls
 * the function of the same op in stubs.fakecuda.driver, which runs the cuda-checkpoint
 * stub's own op logic. The CPython functions are declared here by hand (no headers) and
 * weak: the loading process (the python executable or its libpython) provides them, and
 * loaded anywhere else the library still loads, every checkpoint call and cuInit returning
 * CUDA_ERROR_NOT_INITIALIZED. Built by stubs.fakecuda.build(); -DFAKECUDA_NO_CHECKPOINT_API
 * leaves out the cuCheckpoint* symbols (an r550-like driver).
 */
#include <stddef.h>
#include <stdint.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))
#define WEAK __attribute__((weak))

typedef int CUresult;
typedef struct _object PyObject;

extern int Py_IsInitialized(void) WEAK;
extern int PyGILState_Ensure(void) WEAK;
extern void PyGILState_Release(int) WEAK;
extern PyObject *PyImport_ImportModule(const char *) WEAK;
extern PyObject *PyObject_CallMethod(PyObject *, const char *, const char *, ...) WEAK;
extern long PyLong_AsLong(PyObject *) WEAK;
extern PyObject *PyErr_Occurred(void) WEAK;
extern void PyErr_Print(void) WEAK;
extern void Py_DecRef(PyObject *) WEAK;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_UNKNOWN = 999,
};

/* Keep in step with results.py (tests/test_fakecuda.py checks every code). */
static const struct {
    CUresult code;
    const char *name;
    const char *text;
} ERRORS[] = {
    {0, "CUDA_SUCCESS", "no error"},
    {1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {304, "CUDA_ERROR_OPERATING_SYSTEM", "OS call failed or operation not supported on this OS"},
    {401, "CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"},
    {500, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {801, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {909, "CUDA_ERROR_TIMEOUT", "the operation timed out"},
    {999, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

#ifdef FAKECUDA_NO_CHECKPOINT_API
#define DRIVER_VERSION 12040
#else
#define DRIVER_VERSION 12080
#endif

/* The pid that passed cuInit: a forked child must initialise again. */
static pid_t init_pid;

static int have_python(void) {
    return Py_IsInitialized && PyGILState_Ensure && PyGILState_Release && PyImport_ImportModule &&
           PyObject_CallMethod && PyLong_AsLong && PyErr_Occurred && PyErr_Print && Py_DecRef &&
           Py_IsInitialized();
}

/* driver.<method>(a, b) -> CUresult; any Python error is printed and is CUDA_ERROR_UNKNOWN. */
static CUresult call_driver(const char *method, int a, unsigned long long b) {
    static PyObject *driver; /* the module, imported once; guarded by the GIL */
    CUresult rc = CUDA_ERROR_UNKNOWN;
    if (!have_python())
        return CUDA_ERROR_NOT_INITIALIZED;
    int gil = PyGILState_Ensure();
    if (!driver)
        driver = PyImport_ImportModule("stubs.fakecuda.driver");
    if (driver) {
        PyObject *result = PyObject_CallMethod(driver, method, "iK", a, b);
        if (result) {
            long value = PyLong_AsLong(result);
            if (!(value == -1 && PyErr_Occurred()))
                rc = (CUresult)value;
            Py_DecRef(result);
        }
    }
    if (PyErr_Occurred())
        PyErr_Print();
    PyGILState_Release(gil);
    return rc;
}

EXPORT CUresult cuInit(unsigned int flags) {
    CUresult rc = call_driver("init", (int)flags, 0);
    if (rc == CUDA_SUCCESS)
        __atomic_store_n(&init_pid, getpid(), __ATOMIC_RELEASE);
    return rc;
}

EXPORT CUresult cuDriverGetVersion(int *version) {
    if (!version)
        return CUDA_ERROR_INVALID_VALUE;
    *version = DRIVER_VERSION;
    return CUDA_SUCCESS;
}

static int error_index(CUresult code) {
    for (size_t i = 0; i < sizeof ERRORS / sizeof ERRORS[0]; i++)
        if (ERRORS[i].code == code)
            return (int)i;
    return -1;
}

EXPORT CUresult cuGetErrorName(CUresult code, const char **name) {
    if (!name)
        return CUDA_ERROR_INVALID_VALUE;
    int i = error_index(code);
    *name = i < 0 ? NULL : ERRORS[i].name;
    return i < 0 ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

EXPORT CUresult cuGetErrorString(CUresult code, const char **text) {
    if (!text)
        return CUDA_ERROR_INVALID_VALUE;
    int i = error_index(code);
    *text = i < 0 ? NULL : ERRORS[i].text;
    return i < 0 ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

#ifndef FAKECUDA_NO_CHECKPOINT_API

typedef struct CUcheckpointLockArgs_st {
    unsigned int timeoutMs;
    unsigned int reserved0;
    unsigned long long reserved1[7];
} CUcheckpointLockArgs;

typedef struct CUcheckpointArgs_st {
    unsigned long long reserved[8];
} CUcheckpointCheckpointArgs, CUcheckpointRestoreArgs, CUcheckpointUnlockArgs;

_Static_assert(sizeof(CUcheckpointLockArgs) == 64, "the driver's struct is 64 bytes");
_Static_assert(sizeof(CUcheckpointCheckpointArgs) == 64, "the driver's struct is 64 bytes");

static int initialised(void) { return __atomic_load_n(&init_pid, __ATOMIC_ACQUIRE) == getpid(); }

static int all_zero(const unsigned long long *words, int n) {
    for (int i = 0; i < n; i++)
        if (words[i])
            return 0;
    return 1;
}

/* The checks the driver makes before it looks at the process. */
static CUresult precheck(const unsigned long long *reserved, int n) {
    if (!initialised())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (reserved && !all_zero(reserved, n))
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCheckpointProcessGetState(int pid, int *state) {
    CUresult rc = precheck(NULL, 0);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!state)
        return CUDA_ERROR_INVALID_VALUE;
    return call_driver("get_state", pid, (unsigned long long)(uintptr_t)state);
}

EXPORT CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args) {
    CUresult rc = precheck(args ? args->reserved1 : NULL, 7);
    if (rc == CUDA_SUCCESS && args && args->reserved0)
        rc = CUDA_ERROR_INVALID_VALUE;
    if (rc != CUDA_SUCCESS)
        return rc;
    return call_driver("lock", pid, args ? args->timeoutMs : 0);
}

EXPORT CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args) {
    CUresult rc = precheck(args ? args->reserved : NULL, 8);
    return rc != CUDA_SUCCESS ? rc : call_driver("checkpoint", pid, 0);
}

EXPORT CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args) {
    CUresult rc = precheck(args ? args->reserved : NULL, 8);
    return rc != CUDA_SUCCESS ? rc : call_driver("restore", pid, 0);
}

EXPORT CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args) {
    CUresult rc = precheck(args ? args->reserved : NULL, 8);
    return rc != CUDA_SUCCESS ? rc : call_driver("unlock", pid, 0);
}

EXPORT CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid) {
    (void)pid;
    (void)tid;
    CUresult rc = precheck(NULL, 0);
    return rc != CUDA_SUCCESS ? rc : CUDA_ERROR_NOT_SUPPORTED;
}

#endif
