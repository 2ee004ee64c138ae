/*
 * kvd's HIP backend on an NVIDIA GPU: a library that exports the HIP runtime entry points kvd
 * loads (gpu/src/hip/sys.rs), with ROCm's ABI for them (the AMD headers' types, enum values
 * and struct layouts), and implements each one with the CUDA call that HIP's NVIDIA platform
 * maps it to (the mapping of HIP's hip/nvidia_detail/nvidia_hip_runtime_api.h). kvd loads it
 * in place of libamdhip64.so with KVD_HIP_LIBRARY=/path/libkvd-hip-nvidia.so.
 *
 * Why not compile HIP's own nvidia_detail header: Debian's (ROCm 5.2) targets CUDA 11 and does
 * not compile against CUDA 12 or 13 (removed texture references and cudaDeviceProp fields), and
 * it has no VMM calls at all. So each forwarder is written here, against NVIDIA's own CUDA 13
 * headers, and converts explicitly wherever ROCm's ABI differs from CUDA's:
 *   - hipIpcMemLazyEnablePeerAccess is 0 in ROCm and 1 (cudaIpcMemLazyEnablePeerAccess) in CUDA;
 *   - hipPointer_attribute numbers its values differently from CUpointer_attribute;
 *   - hipDeviceptr_t and hipMemGenericAllocationHandle_t are pointers in ROCm, integers in CUDA;
 *   - hipMemAllocationProp and hipMemAccessDesc are converted field by field.
 * Error codes pass through unchanged: HIP numbers its errors like CUDA's, which the
 * _Static_asserts below check for every code kvd tells apart.
 *
 * What running kvd on this proves: kvd's HIP code — its call sequence, handle and pointer
 * handling, ordering by interprocess events, VMM import by descriptor, release on SIGKILL —
 * moves bytes bit-exactly through a real driver. It proves nothing about AMD's driver, ROCm's
 * implementation of these calls, or SDMA throughput.
 */
#include <stdint.h>
#include <string.h>

#include <cuda.h>
#include <cuda_runtime_api.h>

#define EXPORT __attribute__((visibility("default")))

/* ROCm's ABI, as kvd declares it (checked against ROCm's headers by kvd's hip::abi test). */
typedef int hipError_t;
typedef int hipDevice_t;
typedef void *hipStream_t;
typedef void *hipEvent_t;
typedef void *hipDeviceptr_t;
typedef void *hipMemGenericAllocationHandle_t;
typedef struct { char reserved[64]; } hipIpcMemHandle_t;
typedef struct { char reserved[64]; } hipIpcEventHandle_t;
typedef struct { char bytes[16]; } hipUUID;
typedef struct { int type; int id; } hipMemLocation;
typedef struct { hipMemLocation location; int flags; } hipMemAccessDesc;
typedef struct {
    int type;
    int requestedHandleType;
    hipMemLocation location;
    void *win32HandleMetaData;
    struct { unsigned char compressionType, gpuDirectRDMACapable; unsigned short usage; } allocFlags;
} hipMemAllocationProp; /* ROCm >= 6.0 */

enum {
    hipSuccess = 0,
    hipErrorInvalidValue = 1,
    HIP_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9,
    HIP_POINTER_ATTRIBUTE_IS_LEGACY_HIP_IPC_CAPABLE = 10,
    hipMemHandleTypePosixFileDescriptor = 1,
    hipMemLocationTypeDevice = 1,
    hipMemAccessFlagsProtReadWrite = 3,
    hipMemAllocationTypePinned = 1,
};

/* HIP's error numbers are CUDA's for every code kvd distinguishes. */
_Static_assert(cudaSuccess == 0 && CUDA_SUCCESS == 0, "success");
_Static_assert(cudaErrorInvalidValue == 1 && CUDA_ERROR_INVALID_VALUE == 1, "invalid value");
_Static_assert(cudaErrorMemoryAllocation == 2 && CUDA_ERROR_OUT_OF_MEMORY == 2, "out of memory");
_Static_assert(cudaErrorNoDevice == 100 && CUDA_ERROR_NO_DEVICE == 100, "no device");
_Static_assert(cudaErrorAlreadyMapped == 208 && CUDA_ERROR_ALREADY_MAPPED == 208, "already mapped");
_Static_assert(cudaErrorInvalidResourceHandle == 400 && CUDA_ERROR_INVALID_HANDLE == 400, "handle");
_Static_assert(cudaErrorNotReady == 600 && CUDA_ERROR_NOT_READY == 600, "not ready");
_Static_assert(cudaErrorHostMemoryAlreadyRegistered == 712 &&
               CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED == 712, "already registered");
_Static_assert(cudaErrorNotSupported == 801 && CUDA_ERROR_NOT_SUPPORTED == 801, "not supported");
/* Flags that ROCm and CUDA number alike, passed through. */
_Static_assert(cudaEventBlockingSync == 1 && cudaEventDisableTiming == 2 &&
               cudaEventInterprocess == 4, "event flags");
_Static_assert(cudaStreamNonBlocking == 1, "stream flags");
_Static_assert(cudaHostRegisterPortable == 1 && cudaHostRegisterMapped == 2, "register flags");
_Static_assert(cudaMemcpyDefault == 4, "memcpy kind");
_Static_assert(sizeof(cudaIpcMemHandle_t) == 64 && sizeof(cudaIpcEventHandle_t) == 64, "ipc");
_Static_assert(sizeof(CUdeviceptr) == sizeof(void *), "device pointers");
_Static_assert(sizeof(CUmemGenericAllocationHandle) == sizeof(void *), "allocation handles");

static hipError_t rt(cudaError_t e) { return (hipError_t)e; }
static hipError_t drv(CUresult r) { return (hipError_t)r; }
static CUdeviceptr dptr(const void *p) { return (CUdeviceptr)(uintptr_t)p; }

EXPORT const char *hipGetErrorName(hipError_t e) { return cudaGetErrorName((cudaError_t)e); }
EXPORT const char *hipGetErrorString(hipError_t e) { return cudaGetErrorString((cudaError_t)e); }
EXPORT hipError_t hipInit(unsigned int flags) { return drv(cuInit(flags)); }
EXPORT hipError_t hipRuntimeGetVersion(int *v) { return rt(cudaRuntimeGetVersion(v)); }
EXPORT hipError_t hipGetDeviceCount(int *n) { return rt(cudaGetDeviceCount(n)); }
EXPORT hipError_t hipDeviceGet(hipDevice_t *d, int ordinal) { return drv(cuDeviceGet(d, ordinal)); }

/* HIP 5.2's header copies the UUID with strncpy, which stops at the first zero byte and leaves
 * the rest of the caller's buffer as it was; all sixteen bytes are copied here. */
EXPORT hipError_t hipDeviceGetUuid(hipUUID *u, hipDevice_t d) {
    CUuuid id;
    if (u == NULL) return hipErrorInvalidValue;
    CUresult r = cuDeviceGetUuid(&id, d);
    if (r == CUDA_SUCCESS) memcpy(u->bytes, id.bytes, sizeof u->bytes);
    return drv(r);
}

EXPORT hipError_t hipDeviceGetName(char *name, int len, hipDevice_t d) {
    return drv(cuDeviceGetName(name, len, d));
}
EXPORT hipError_t hipSetDevice(int ordinal) { return rt(cudaSetDevice(ordinal)); }
EXPORT hipError_t hipDeviceSynchronize(void) { return rt(cudaDeviceSynchronize()); }
EXPORT hipError_t hipMemGetInfo(size_t *free, size_t *total) { return rt(cudaMemGetInfo(free, total)); }
EXPORT hipError_t hipMalloc(void **p, size_t n) { return rt(cudaMalloc(p, n)); }
EXPORT hipError_t hipFree(void *p) { return rt(cudaFree(p)); }
EXPORT hipError_t hipHostRegister(void *p, size_t n, unsigned int flags) {
    return rt(cudaHostRegister(p, n, flags));
}
EXPORT hipError_t hipHostUnregister(void *p) { return rt(cudaHostUnregister(p)); }

EXPORT hipError_t hipPointerGetAttribute(void *data, int attr, hipDeviceptr_t p) {
    CUpointer_attribute a;
    switch (attr) {
    case HIP_POINTER_ATTRIBUTE_DEVICE_ORDINAL: a = CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL; break;
    case HIP_POINTER_ATTRIBUTE_IS_LEGACY_HIP_IPC_CAPABLE:
        a = CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE;
        break;
    default: return hipErrorInvalidValue; /* not forwarded: kvd asks for no other */
    }
    return drv(cuPointerGetAttribute(data, a, dptr(p)));
}

EXPORT hipError_t hipMemGetAddressRange(hipDeviceptr_t *base, size_t *size, hipDeviceptr_t p) {
    CUdeviceptr b = 0;
    CUresult r = cuMemGetAddressRange(&b, size, dptr(p));
    if (r == CUDA_SUCCESS && base) *base = (void *)(uintptr_t)b;
    return drv(r);
}

EXPORT hipError_t hipIpcGetMemHandle(hipIpcMemHandle_t *h, void *p) {
    cudaIpcMemHandle_t c;
    cudaError_t e = cudaIpcGetMemHandle(&c, p);
    if (e == cudaSuccess) memcpy(h->reserved, c.reserved, 64);
    return rt(e);
}

EXPORT hipError_t hipIpcOpenMemHandle(void **p, hipIpcMemHandle_t h, unsigned int flags) {
    cudaIpcMemHandle_t c;
    memcpy(c.reserved, h.reserved, 64);
    /* ROCm's only flag, hipIpcMemLazyEnablePeerAccess, is 0; CUDA's is 1 and required. */
    if (flags != 0) return hipErrorInvalidValue;
    return rt(cudaIpcOpenMemHandle(p, c, cudaIpcMemLazyEnablePeerAccess));
}

EXPORT hipError_t hipIpcCloseMemHandle(void *p) { return rt(cudaIpcCloseMemHandle(p)); }
EXPORT hipError_t hipEventCreateWithFlags(hipEvent_t *e, unsigned flags) {
    return rt(cudaEventCreateWithFlags((cudaEvent_t *)e, flags));
}
EXPORT hipError_t hipEventDestroy(hipEvent_t e) { return rt(cudaEventDestroy((cudaEvent_t)e)); }
EXPORT hipError_t hipEventRecord(hipEvent_t e, hipStream_t s) {
    return rt(cudaEventRecord((cudaEvent_t)e, (cudaStream_t)s));
}
EXPORT hipError_t hipEventQuery(hipEvent_t e) { return rt(cudaEventQuery((cudaEvent_t)e)); }
EXPORT hipError_t hipEventSynchronize(hipEvent_t e) {
    return rt(cudaEventSynchronize((cudaEvent_t)e));
}

EXPORT hipError_t hipIpcGetEventHandle(hipIpcEventHandle_t *h, hipEvent_t e) {
    cudaIpcEventHandle_t c;
    cudaError_t r = cudaIpcGetEventHandle(&c, (cudaEvent_t)e);
    if (r == cudaSuccess) memcpy(h->reserved, c.reserved, 64);
    return rt(r);
}

EXPORT hipError_t hipIpcOpenEventHandle(hipEvent_t *e, hipIpcEventHandle_t h) {
    cudaIpcEventHandle_t c;
    memcpy(c.reserved, h.reserved, 64);
    return rt(cudaIpcOpenEventHandle((cudaEvent_t *)e, c));
}

EXPORT hipError_t hipStreamCreateWithFlags(hipStream_t *s, unsigned int flags) {
    return rt(cudaStreamCreateWithFlags((cudaStream_t *)s, flags));
}
EXPORT hipError_t hipStreamDestroy(hipStream_t s) { return rt(cudaStreamDestroy((cudaStream_t)s)); }
EXPORT hipError_t hipStreamWaitEvent(hipStream_t s, hipEvent_t e, unsigned int flags) {
    return rt(cudaStreamWaitEvent((cudaStream_t)s, (cudaEvent_t)e, flags));
}

static int memcpy_kind(int kind, enum cudaMemcpyKind *out) {
    switch (kind) { /* ROCm numbers hipMemcpyKind like cudaMemcpyKind */
    case 0: *out = cudaMemcpyHostToHost; return 1;
    case 1: *out = cudaMemcpyHostToDevice; return 1;
    case 2: *out = cudaMemcpyDeviceToHost; return 1;
    case 3: *out = cudaMemcpyDeviceToDevice; return 1;
    case 4: *out = cudaMemcpyDefault; return 1;
    default: return 0;
    }
}

EXPORT hipError_t hipMemcpy(void *dst, const void *src, size_t n, int kind) {
    enum cudaMemcpyKind k;
    if (!memcpy_kind(kind, &k)) return hipErrorInvalidValue;
    return rt(cudaMemcpy(dst, src, n, k));
}

EXPORT hipError_t hipMemcpyAsync(void *dst, const void *src, size_t n, int kind, hipStream_t s) {
    enum cudaMemcpyKind k;
    if (!memcpy_kind(kind, &k)) return hipErrorInvalidValue;
    return rt(cudaMemcpyAsync(dst, src, n, k, (cudaStream_t)s));
}

EXPORT hipError_t hipMemsetD8Async(hipDeviceptr_t p, unsigned char v, size_t n, hipStream_t s) {
    return drv(cuMemsetD8Async(dptr(p), v, n, (CUstream)s));
}

static int location(const hipMemLocation *l, CUmemLocation *out) {
    if (l->type != hipMemLocationTypeDevice) return 0;
    out->type = CU_MEM_LOCATION_TYPE_DEVICE;
    out->id = l->id;
    return 1;
}

EXPORT hipError_t hipMemCreate(hipMemGenericAllocationHandle_t *h, size_t size,
                               const hipMemAllocationProp *prop, unsigned long long flags) {
    CUmemAllocationProp p;
    memset(&p, 0, sizeof p);
    if (prop->type != hipMemAllocationTypePinned || !location(&prop->location, &p.location))
        return hipErrorInvalidValue;
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    if (prop->requestedHandleType == hipMemHandleTypePosixFileDescriptor)
        p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    else if (prop->requestedHandleType != 0)
        return hipErrorInvalidValue;
    CUmemGenericAllocationHandle c = 0;
    CUresult r = cuMemCreate(&c, size, &p, flags);
    if (r == CUDA_SUCCESS) *h = (void *)(uintptr_t)c;
    return drv(r);
}

EXPORT hipError_t hipMemRelease(hipMemGenericAllocationHandle_t h) {
    return drv(cuMemRelease((CUmemGenericAllocationHandle)(uintptr_t)h));
}

EXPORT hipError_t hipMemRetainAllocationHandle(hipMemGenericAllocationHandle_t *h, void *p) {
    CUmemGenericAllocationHandle c = 0;
    CUresult r = cuMemRetainAllocationHandle(&c, p);
    if (r == CUDA_SUCCESS) *h = (void *)(uintptr_t)c;
    return drv(r);
}

EXPORT hipError_t hipMemExportToShareableHandle(void *out, hipMemGenericAllocationHandle_t h,
                                                int type, unsigned long long flags) {
    if (type != hipMemHandleTypePosixFileDescriptor) return hipErrorInvalidValue;
    return drv(cuMemExportToShareableHandle(out, (CUmemGenericAllocationHandle)(uintptr_t)h,
                                            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, flags));
}

EXPORT hipError_t hipMemImportFromShareableHandle(hipMemGenericAllocationHandle_t *h, void *os,
                                                  int type) {
    if (type != hipMemHandleTypePosixFileDescriptor) return hipErrorInvalidValue;
    CUmemGenericAllocationHandle c = 0;
    CUresult r = cuMemImportFromShareableHandle(&c, os, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (r == CUDA_SUCCESS) *h = (void *)(uintptr_t)c;
    return drv(r);
}

EXPORT hipError_t hipMemAddressReserve(void **p, size_t size, size_t align, void *addr,
                                       unsigned long long flags) {
    CUdeviceptr c = 0;
    CUresult r = cuMemAddressReserve(&c, size, align, dptr(addr), flags);
    if (r == CUDA_SUCCESS) *p = (void *)(uintptr_t)c;
    return drv(r);
}

EXPORT hipError_t hipMemAddressFree(void *p, size_t size) {
    return drv(cuMemAddressFree(dptr(p), size));
}

EXPORT hipError_t hipMemMap(void *p, size_t size, size_t offset, hipMemGenericAllocationHandle_t h,
                            unsigned long long flags) {
    return drv(cuMemMap(dptr(p), size, offset, (CUmemGenericAllocationHandle)(uintptr_t)h, flags));
}

EXPORT hipError_t hipMemUnmap(void *p, size_t size) { return drv(cuMemUnmap(dptr(p), size)); }

EXPORT hipError_t hipMemSetAccess(void *p, size_t size, const hipMemAccessDesc *desc,
                                  size_t count) {
    CUmemAccessDesc d[8];
    if (count > 8) return hipErrorInvalidValue;
    for (size_t i = 0; i < count; i++) {
        if (!location(&desc[i].location, &d[i].location) ||
            desc[i].flags != hipMemAccessFlagsProtReadWrite)
            return hipErrorInvalidValue;
        d[i].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    }
    return drv(cuMemSetAccess(dptr(p), size, d, count));
}
