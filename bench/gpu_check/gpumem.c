/*
 * gpumem: hold N GiB of GPU memory through the CUDA driver API, for bench/gpu_check.sh.
 *
 *   gpumem [--lib PATH] probe      one line about GPU 0: name, memory, checkpoint API
 *   gpumem [--lib PATH] GIB        allocate GIB GiB on GPU 0, fill it, then serve stdin
 *
 * No CUDA toolkit is needed: libcuda.so.1 (the driver's library; --lib overrides) is
 * dlopened and the few driver functions used are declared here by hand, under the _v2
 * names the real library exports for the 64-bit API.
 *
 * Holding: the memory is allocated in chunks of at most 1 GiB and filled with cuMemsetD32
 * in stripes of 64 MiB, each stripe with its own 32-bit value (a function of its offset),
 * so a restore that put back the wrong bytes, or the right bytes at the wrong place, is
 * seen. It then prints "ready pid=P bytes=N" and reads commands on stdin, one a line:
 *   verify   copy back 3 windows of 4 KiB of every stripe (its start, middle and end) and
 *            compare them with the pattern: prints "ok", or "bad at OFFSET read=.. want=.."
 *   quit     free the memory and exit 0 (end of input does the same)
 * While it waits for a command it makes no CUDA call, so cuda-checkpoint may lock,
 * checkpoint, restore and unlock it between commands.
 *
 * Exit: 0 done; 77 no usable GPU (libcuda missing, cuInit or cuDeviceGet failed: the
 * reason on stderr); 1 any other CUDA failure; 2 bad usage.
 */
#define _POSIX_C_SOURCE 200809L
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult; /* enum cudaError_enum: 0 is CUDA_SUCCESS */
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr; /* CUdeviceptr_v2 */

static CUresult (*p_cuInit)(unsigned int);
static CUresult (*p_cuDriverGetVersion)(int *);
static CUresult (*p_cuDeviceGet)(CUdevice *, int);
static CUresult (*p_cuDeviceGetName)(char *, int, CUdevice);
static CUresult (*p_cuDeviceTotalMem_v2)(size_t *, CUdevice);
static CUresult (*p_cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
static CUresult (*p_cuDevicePrimaryCtxRelease_v2)(CUdevice);
static CUresult (*p_cuCtxSetCurrent)(CUcontext);
static CUresult (*p_cuCtxSynchronize)(void);
static CUresult (*p_cuMemGetInfo_v2)(size_t *, size_t *);
static CUresult (*p_cuMemAlloc_v2)(CUdeviceptr *, size_t);
static CUresult (*p_cuMemFree_v2)(CUdeviceptr);
static CUresult (*p_cuMemsetD32_v2)(CUdeviceptr, unsigned int, size_t);
static CUresult (*p_cuMemcpyDtoH_v2)(void *, CUdeviceptr, size_t);
static CUresult (*p_cuGetErrorString)(CUresult, const char **);

#define CHUNK (1ULL << 30)
#define STRIPE (64ULL << 20)
#define WINDOW 4096ULL

static void *lib;
static const char *lib_path = "libcuda.so.1";

static const char *errstr(CUresult r) {
    const char *s = NULL;
    if (p_cuGetErrorString == NULL || p_cuGetErrorString(r, &s) != 0 || s == NULL)
        return "unknown CUDA error";
    return s;
}

static void *sym(const char *name) {
    void *f = dlsym(lib, name);
    if (f == NULL) {
        fprintf(stderr, "gpumem: %s does not export %s (driver too old?)\n", lib_path, name);
        exit(77);
    }
    return f;
}

/* The POSIX idiom for a function pointer from dlsym (dlopen(3)). */
#define LOAD(name) (*(void **)(&p_##name) = sym(#name))

static void load(void) {
    lib = dlopen(lib_path, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        fprintf(stderr, "gpumem: cannot load %s: %s (no NVIDIA driver here?)\n", lib_path,
                dlerror());
        exit(77);
    }
    LOAD(cuGetErrorString);
    LOAD(cuInit);
    LOAD(cuDriverGetVersion);
    LOAD(cuDeviceGet);
    LOAD(cuDeviceGetName);
    LOAD(cuDeviceTotalMem_v2);
    LOAD(cuDevicePrimaryCtxRetain);
    LOAD(cuDevicePrimaryCtxRelease_v2);
    LOAD(cuCtxSetCurrent);
    LOAD(cuCtxSynchronize);
    LOAD(cuMemGetInfo_v2);
    LOAD(cuMemAlloc_v2);
    LOAD(cuMemFree_v2);
    LOAD(cuMemsetD32_v2);
    LOAD(cuMemcpyDtoH_v2);
}

static void check(CUresult r, const char *what, int exit_code) {
    if (r != 0) {
        fprintf(stderr, "gpumem: %s failed: %s (CUresult %d)\n", what, errstr(r), r);
        exit(exit_code);
    }
}

static CUdevice open_device(void) {
    CUdevice dev = 0;
    CUcontext ctx = NULL;
    check(p_cuInit(0), "cuInit", 77);
    check(p_cuDeviceGet(&dev, 0), "cuDeviceGet(0)", 77);
    check(p_cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain", 1);
    check(p_cuCtxSetCurrent(ctx), "cuCtxSetCurrent", 1);
    return dev;
}

static int probe(void) {
    char name[256] = {0};
    size_t total = 0, free_b = 0, total_ctx = 0;
    int version = 0;
    CUdevice dev = open_device();
    check(p_cuDriverGetVersion(&version), "cuDriverGetVersion", 1);
    check(p_cuDeviceGetName(name, (int)sizeof name - 1, dev), "cuDeviceGetName", 1);
    check(p_cuDeviceTotalMem_v2(&total, dev), "cuDeviceTotalMem_v2", 1);
    check(p_cuMemGetInfo_v2(&free_b, &total_ctx), "cuMemGetInfo_v2", 1);
    for (char *c = name; *c; c++)
        if (*c == '"') *c = '\'';
    printf("gpu name=\"%s\" total=%zu free=%zu cuda=%d checkpoint_api=%d\n", name, total,
           free_b, version, dlsym(lib, "cuCheckpointProcessLock") != NULL);
    check(p_cuDevicePrimaryCtxRelease_v2(dev), "cuDevicePrimaryCtxRelease_v2", 1);
    return 0;
}

static unsigned int pattern(unsigned long long offset) {
    /* Per stripe: never 0 (fresh memory often is), different for every stripe. */
    unsigned long long s = offset / STRIPE;
    return (unsigned int)(0x5A17C0DEu ^ (unsigned int)(s * 2654435761ULL)) | 1u;
}

static CUdeviceptr *chunks;
static size_t nchunks;
static unsigned long long total_bytes;

static size_t chunk_bytes(size_t i) {
    unsigned long long left = total_bytes - (unsigned long long)i * CHUNK;
    return (size_t)(left < CHUNK ? left : CHUNK);
}

static void allocate_and_fill(void) {
    nchunks = (size_t)((total_bytes + CHUNK - 1) / CHUNK);
    chunks = calloc(nchunks, sizeof *chunks);
    if (chunks == NULL) {
        fprintf(stderr, "gpumem: out of host memory\n");
        exit(1);
    }
    for (size_t i = 0; i < nchunks; i++) {
        char what[96];
        snprintf(what, sizeof what, "cuMemAlloc_v2 (chunk %zu of %zu)", i + 1, nchunks);
        check(p_cuMemAlloc_v2(&chunks[i], chunk_bytes(i)), what, 1);
        /* CHUNK is a multiple of STRIPE, so stripes never straddle chunks. */
        for (unsigned long long off = 0; off < chunk_bytes(i); off += STRIPE) {
            unsigned long long len = chunk_bytes(i) - off < STRIPE ? chunk_bytes(i) - off : STRIPE;
            unsigned long long global = (unsigned long long)i * CHUNK + off;
            check(p_cuMemsetD32_v2(chunks[i] + off, pattern(global), (size_t)(len / 4)),
                  "cuMemsetD32_v2", 1);
        }
    }
    check(p_cuCtxSynchronize(), "cuCtxSynchronize", 1);
}

/* 0: all windows match; 1: a mismatch (printed); -1: a CUDA error (printed). */
static int verify_window(unsigned long long at, unsigned int *buf) {
    size_t i = (size_t)(at / CHUNK);
    unsigned long long off = at % CHUNK;
    unsigned long long len = chunk_bytes(i) - off < WINDOW ? chunk_bytes(i) - off : WINDOW;
    CUresult r = p_cuMemcpyDtoH_v2(buf, chunks[i] + off, (size_t)len);
    if (r != 0) {
        printf("error cuMemcpyDtoH_v2 at %llu: %s\n", at, errstr(r));
        return -1;
    }
    for (size_t w = 0; w < len / 4; w++) {
        unsigned long long where = at + 4 * w;
        if (buf[w] != pattern(where)) {
            printf("bad at %llu read=0x%08x want=0x%08x\n", where, buf[w], pattern(where));
            return 1;
        }
    }
    return 0;
}

static void verify(void) {
    static unsigned int buf[WINDOW / 4];
    for (unsigned long long s = 0; s < total_bytes; s += STRIPE) {
        unsigned long long len = total_bytes - s < STRIPE ? total_bytes - s : STRIPE;
        unsigned long long starts[3] = {s, s + len / 2 / 4 * 4, s + len - (len < WINDOW ? len : WINDOW)};
        for (int k = 0; k < 3; k++)
            if (verify_window(starts[k], buf) != 0) return;
    }
    CUresult r = p_cuCtxSynchronize();
    if (r != 0) {
        printf("error cuCtxSynchronize: %s\n", errstr(r));
        return;
    }
    printf("ok\n");
}

static int serve(void) {
    char line[128];
    while (fgets(line, sizeof line, stdin) != NULL) {
        line[strcspn(line, "\r\n")] = '\0';
        if (strcmp(line, "verify") == 0)
            verify();
        else if (strcmp(line, "quit") == 0)
            break;
        else if (line[0] != '\0')
            printf("error unknown command %s (verify, quit)\n", line);
        fflush(stdout);
    }
    for (size_t i = 0; i < nchunks; i++) check(p_cuMemFree_v2(chunks[i]), "cuMemFree_v2", 1);
    free(chunks);
    return 0;
}

int main(int argc, char **argv) {
    int a = 1;
    if (a + 1 < argc && strcmp(argv[a], "--lib") == 0) {
        lib_path = argv[a + 1];
        a += 2;
    }
    if (a + 1 != argc) {
        fprintf(stderr, "usage: gpumem [--lib PATH] probe | GIB\n");
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (strcmp(argv[a], "probe") == 0) {
        load();
        return probe();
    }
    char *end = NULL;
    double gib = strtod(argv[a], &end);
    if (end == argv[a] || *end != '\0' || !(gib > 0) || gib > 1e6) {
        fprintf(stderr, "gpumem: GIB must be a positive number, got %s\n", argv[a]);
        return 2;
    }
    total_bytes = (unsigned long long)(gib * (double)(1ULL << 30)) / 4 * 4;
    if (total_bytes == 0) {
        fprintf(stderr, "gpumem: %s GiB is less than 4 bytes\n", argv[a]);
        return 2;
    }
    load();
    open_device();
    allocate_and_fill();
    printf("ready pid=%ld bytes=%llu\n", (long)getpid(), total_bytes);
    return serve();
}
