/* A stand-in libcuda.so.1 for CPU tests of megamoe_cli/jit/driver.py through cuda.bindings.
 *
 * The binding resolves every entry point through cuGetProcAddress_v2; this library answers with
 * its own symbols, records what each call was given (fake_* accessors, read through ctypes from
 * the same process) and hands back fixed values, so a test sees exactly what a launch, a module
 * load or a tensor-map encode passes to the driver.  Device "memory" is host memory here.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

typedef int CUresult;
enum { OK = 0, INVALID_VALUE = 1, INVALID_HANDLE = 400, NOT_FOUND = 500 };

typedef struct { unsigned x, y, z; } Dim3;
typedef struct { int id; char pad[4]; union { Dim3 cluster; char raw[64]; } value; } LaunchAttribute;
typedef struct {
    unsigned grid[3], block[3], smem;
    void* stream;
    LaunchAttribute* attrs;
    unsigned num_attrs;
} LaunchConfig;

/* What the last launch was given: function, grid, block, smem, stream, cluster (0s: none),
 * attribute id, and the first 64 bytes of its parameter block and that block's address. */
typedef struct {
    uint64_t function, grid[3], block[3], smem, stream, cluster[3], attribute_id, params_address;
    unsigned char params[64];
} Launch;

static Launch last_launch;
static int launches, context_sets, fail_next_launch;
static uint64_t current_context;
static int current_device;
static unsigned char module_image[16];
static unsigned char global_counters[48];
static int func_attribute_set[2];
static unsigned occupancy_cluster;

Launch* fake_last_launch(void) { return &last_launch; }
int fake_launches(void) { return launches; }
int fake_context_sets(void) { return context_sets; }
void fake_fail_next_launch(int code) { fail_next_launch = code; }
void fake_set_current_context(uint64_t context) { current_context = context; }
unsigned char* fake_module_image(void) { return module_image; }
unsigned char* fake_global_counters(void) { return global_counters; }
int* fake_func_attribute_set(void) { return func_attribute_set; }
unsigned fake_occupancy_cluster(void) { return occupancy_cluster; }

CUresult cuInit(unsigned flags) { return OK; }
CUresult cuDriverGetVersion(int* version) { *version = 13000; return OK; }
CUresult cuDeviceGetCount(int* count) { *count = 2; return OK; }
CUresult cuDeviceGet(int* device, int ordinal) { *device = ordinal; return ordinal < 2 ? OK : INVALID_VALUE; }

CUresult cuGetErrorName(CUresult error, const char** name) {
    switch (error) {
        case INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; return OK;
        case INVALID_HANDLE: *name = "CUDA_ERROR_INVALID_HANDLE"; return OK;
        case NOT_FOUND: *name = "CUDA_ERROR_NOT_FOUND"; return OK;
        default: *name = NULL; return INVALID_VALUE;
    }
}
CUresult cuGetErrorString(CUresult error, const char** text) {
    *text = error == INVALID_VALUE ? "invalid argument" : "named symbol not found";
    return OK;
}

CUresult cuDevicePrimaryCtxRetain(uint64_t* context, int device) { *context = 0xC000 + device; return OK; }
CUresult cuCtxGetCurrent(uint64_t* context) { *context = current_context; return OK; }
CUresult cuCtxSetCurrent(uint64_t context) {
    context_sets++;
    current_context = context;
    current_device = (int)(context - 0xC000);
    return OK;
}
CUresult cuCtxGetDevice(int* device) { *device = current_device; return OK; }

CUresult cuModuleLoadData(uint64_t* module, const void* image) {
    memcpy(module_image, image, sizeof(module_image));
    *module = 0x5000;
    return OK;
}
CUresult cuModuleGetFunction(uint64_t* function, uint64_t module, const char* name) {
    if (module != 0x5000 || strcmp(name, "k") != 0) return NOT_FOUND;
    *function = 0x6000;
    return OK;
}
CUresult cuModuleGetGlobal(uint64_t* address, size_t* bytes, uint64_t module, const char* name) {
    if (module != 0x5000 || strcmp(name, "megamoe_profile") != 0) return NOT_FOUND;
    *address = (uint64_t)(uintptr_t)global_counters;
    *bytes = sizeof(global_counters);
    return OK;
}
CUresult cuMemcpyDtoH(void* dst, uint64_t src, size_t bytes) { memcpy(dst, (void*)(uintptr_t)src, bytes); return OK; }
CUresult cuMemsetD8(uint64_t dst, unsigned char value, size_t bytes) { memset((void*)(uintptr_t)dst, value, bytes); return OK; }

CUresult cuFuncGetAttribute(int* value, int attribute, uint64_t function) {
    if (function != 0x6000) return INVALID_HANDLE;
    *value = attribute == 4 ? 168 : 0; /* CU_FUNC_ATTRIBUTE_NUM_REGS */
    return OK;
}
CUresult cuFuncSetAttribute(uint64_t function, int attribute, int value) {
    func_attribute_set[0] = attribute;
    func_attribute_set[1] = value;
    return function == 0x6000 ? OK : INVALID_HANDLE;
}
CUresult cuFuncGetParamInfo(uint64_t function, size_t index, size_t* offset, size_t* size) {
    if (index > 0) return INVALID_VALUE;
    *offset = 0;
    *size = 24;
    return OK;
}
CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, uint64_t function, int threads, size_t smem) {
    *blocks = smem > 200000 ? 0 : 1;
    return OK;
}
CUresult cuOccupancyMaxActiveClusters(int* clusters, uint64_t function, const LaunchConfig* config) {
    occupancy_cluster = config->num_attrs ? config->attrs[0].value.cluster.x : 0;
    *clusters = 132 / (occupancy_cluster ? occupancy_cluster : 1);
    return OK;
}

static void record(uint64_t function, const unsigned grid[3], const unsigned block[3], unsigned smem, void* stream,
                   void** params) {
    launches++;
    last_launch.function = function;
    for (int i = 0; i < 3; ++i) last_launch.grid[i] = grid[i], last_launch.block[i] = block[i];
    last_launch.smem = smem;
    last_launch.stream = (uint64_t)(uintptr_t)stream;
    last_launch.params_address = params ? (uint64_t)(uintptr_t)params[0] : 0;
    if (params) memcpy(last_launch.params, params[0], sizeof(last_launch.params));
}

CUresult cuLaunchKernel(uint64_t function, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned smem, void* stream, void** params, void** extra) {
    unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
    if (fail_next_launch) { int code = fail_next_launch; fail_next_launch = 0; return code; }
    record(function, grid, block, smem, stream, params);
    memset(last_launch.cluster, 0, sizeof(last_launch.cluster));
    last_launch.attribute_id = 0;
    return extra ? INVALID_VALUE : OK;
}
CUresult cuLaunchKernelEx(const LaunchConfig* config, uint64_t function, void** params, void** extra) {
    if (fail_next_launch) { int code = fail_next_launch; fail_next_launch = 0; return code; }
    record(function, config->grid, config->block, config->smem, config->stream, params);
    if (config->num_attrs) {
        last_launch.attribute_id = config->attrs[0].id;
        last_launch.cluster[0] = config->attrs[0].value.cluster.x;
        last_launch.cluster[1] = config->attrs[0].value.cluster.y;
        last_launch.cluster[2] = config->attrs[0].value.cluster.z;
    }
    return extra ? INVALID_VALUE : OK;
}

/* The map's first 16 words hold what it was given, so a test can read it back from the bytes. */
CUresult cuTensorMapEncodeTiled(uint64_t* map, int dtype, unsigned rank, void* address, const uint64_t* dims,
                                const uint64_t* strides, const unsigned* box, const unsigned* element_strides,
                                int interleave, int swizzle, int l2_promotion, int oob_fill) {
    uint64_t args[16] = {(uint64_t)dtype, rank, (uint64_t)(uintptr_t)address, dims[0], dims[1], strides[0],
                         box[0], box[1], element_strides[0], element_strides[1], (uint64_t)interleave,
                         (uint64_t)swizzle, (uint64_t)l2_promotion, (uint64_t)oob_fill, 0, 0};
    memcpy(map, args, sizeof(args));
    return OK;
}

CUresult cuDeviceGetPCIBusId(char* out, int length, int device) {
    snprintf(out, length, "0000:%02x:00.0", 0x18 + device);
    return OK;
}
CUresult cuDeviceGetByPCIBusId(int* device, const char* bus_id) {
    unsigned bus;
    if (sscanf(bus_id, "0000:%x:00.0", &bus) != 1 || bus < 0x18 || bus > 0x19) return INVALID_VALUE;
    *device = (int)(bus - 0x18);
    return OK;
}
CUresult cuDeviceGetP2PAttribute(int* value, int attribute, int device, int peer) {
    *value = attribute == 3 && device != peer; /* CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED */
    return OK;
}
CUresult cuMemGetAddressRange(uint64_t* base, size_t* size, uint64_t ptr) {
    *base = ptr & ~(uint64_t)0xFFFF;
    *size = 0x10000;
    return OK;
}
CUresult cuIpcGetMemHandle(unsigned char* handle, uint64_t base) {
    for (int i = 0; i < 64; ++i) handle[i] = (unsigned char)(i % 3 ? 0 : (base >> 16) + i);
    return OK;
}
typedef struct { unsigned char reserved[64]; } IpcHandle;  /* passed by value, as in cuda.h */
CUresult cuIpcOpenMemHandle(uint64_t* mapped, IpcHandle handle, unsigned flags) {
    *mapped = flags == 1 ? 0x70000 + handle.reserved[0] + handle.reserved[63] : 0;
    return flags == 1 ? OK : INVALID_VALUE;
}
CUresult cuIpcCloseMemHandle(uint64_t mapped) { return OK; }

CUresult cuGetProcAddress_v2(const char* symbol, void** function, int version, uint64_t flags, int* status) {
    *function = dlsym(RTLD_DEFAULT, symbol);
    if (status) *status = *function ? 0 : 1; /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
    return *function ? OK : NOT_FOUND;
}
CUresult cuGetProcAddress(const char* symbol, void** function, int version, uint64_t flags) {
    return cuGetProcAddress_v2(symbol, function, version, flags, NULL);
}
