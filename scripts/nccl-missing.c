/* The NCCL 2.30 entry points that torch 2.14 (vLLM 0.33's) links and the GPU host's NCCL 2.28.9
 * (torch 2.11's) lacks. Python loads extension modules with RTLD_NOW, so libtorch_cuda.so fails to
 * load while any of them is missing, although an engine on one GPU never calls them. Preloaded by
 * scripts/device-vllm.sh for vLLM 0.33 runs only: each answers ncclInvalidUsage (5), should one be
 * called after all. The list is what `nm -D` showed missing on the host (session 14). */
#define MISSING(name) int name(void) { return 5; }
MISSING(ncclCommGetUniqueId)
MISSING(ncclCommGrow)
MISSING(ncclCommMemStats)
MISSING(ncclCommResume)
MISSING(ncclCommSuspend)
MISSING(ncclGetLsaMultimemDevicePointer)
MISSING(ncclGetPeerDevicePointer)
MISSING(ncclPutSignal)
MISSING(ncclSignal)
MISSING(ncclWaitSignal)
MISSING(ncclWinGetUserPtr)
