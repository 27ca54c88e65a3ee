/*
 * A stand-in for libnvidia-ml.so.1, for gpubudget-nvml-limits' tests: NOT the NVIDIA driver (no R615 driver is
 * available here). It has the six entry points the crate resolves, with the signatures and the struct layouts
 * of CUDA 13.4's nvml.h.
 *
 * Built twice by tests/standin.rs:
 *   -DSTANDIN_R615   has nvmlDeviceGetMemoryLimits_v1 and nvmlDeviceSetMemoryLimits_v1, driver "615.10.00";
 *   (without)        has no limit call, driver "580.159.04": the shape of the H100's driver here.
 *
 * What the getter answers comes from a table in the file "<this library's path>.table", read at each call
 * (each test copies the library into its own directory and writes its own table beside it). One line per
 * cgroup path:
 *   <path> <soft> <hard> <used>   limits set (decimal bytes; soft 0 / hard 18446744073709551615: none)
 *   <path> NOT_FOUND              no limit on that cgroup (NVML_ERROR_NOT_FOUND)
 *   <path> NOT_SUPPORTED          the driver does not partition it (NVML_ERROR_NOT_SUPPORTED)
 *   <path> LAYOUT                 writes sizeof and the field offsets of its struct into it: soft = offset of
 *                                 softLimit, hard = offset of hardLimit, used = sizeof, so the test can compare
 *                                 them with the Rust struct's
 *   <path> INITS                  soft = hard = 0, used = how many nvmlInit_v2 are not yet matched by an
 *                                 nvmlShutdown (the crate's Drop must shut down what it initialised)
 *   <path> DENY                   the getter answers NOT_FOUND, the setter NVML_ERROR_NO_PERMISSION (a caller
 *                                 without root)
 * The last line for a path is the one that answers. A path in no line answers NVML_ERROR_NOT_FOUND.
 *
 * The setter appends "<path> <soft> <hard> <used>" (used: that path's last figure, else 0), so the getter reads
 * back what was set; it answers NVML_ERROR_NOT_SUPPORTED where the path's last line is NOT_SUPPORTED and
 * refuses soft > hard (NVML_ERROR_INVALID_ARGUMENT). For a path whose last line is LAYOUT it appends its own
 * struct's layout instead: soft = offset of softLimit, hard = offset of hardLimit, used = sizeof.
 *
 * The one GPU is "GPU-standin-0"; other UUIDs are
 * NVML_ERROR_NOT_FOUND from nvmlDeviceGetHandleByUUID.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int nvmlReturn_t;
typedef struct nvmlDevice_st *nvmlDevice_t;

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_NO_PERMISSION 4
#define NVML_ERROR_UNKNOWN 999

typedef struct {
    const char *nameSpace;
    unsigned long long softLimit;
    unsigned long long hardLimit;
    unsigned long long currentUsed;
} nvmlGetMemoryLimits_v1_t;

_Static_assert(sizeof(nvmlGetMemoryLimits_v1_t) == 32, "nvml.h (CUDA 13.4): 32 bytes on x86-64");

typedef struct {
    const char *nameSpace;
    unsigned long long softLimit;
    unsigned long long hardLimit;
} nvmlSetMemoryLimits_v1_t;

_Static_assert(sizeof(nvmlSetMemoryLimits_v1_t) == 24, "nvml.h (CUDA 13.4): 24 bytes on x86-64");

static int initialised;
static struct nvmlDevice_st { int index; } the_gpu;

nvmlReturn_t nvmlInit_v2(void) {
    initialised++;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlShutdown(void) {
    if (initialised == 0) return NVML_ERROR_UNINITIALIZED;
    initialised--;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
#ifdef STANDIN_R615
    const char *mine = "615.10.00";
#else
    const char *mine = "580.159.04";
#endif
    if (version == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(mine) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(version, mine);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (uuid == NULL || device == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (strcmp(uuid, "GPU-standin-0") != 0) return NVML_ERROR_NOT_FOUND;
    *device = &the_gpu;
    return NVML_SUCCESS;
}

#ifdef STANDIN_R615
/* The table's file: this library's own path plus ".table". */
static FILE *open_table(void) {
    Dl_info info;
    if (dladdr((void *)&open_table, &info) == 0 || info.dli_fname == NULL) return NULL;
    char path[4096];
    if (snprintf(path, sizeof path, "%s.table", info.dli_fname) >= (int)sizeof path) return NULL;
    return fopen(path, "r");
}

nvmlReturn_t nvmlDeviceGetMemoryLimits_v1(nvmlDevice_t device, nvmlGetMemoryLimits_v1_t *limits) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (device != &the_gpu || limits == NULL || limits->nameSpace == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    FILE *table = open_table();
    if (table == NULL) return NVML_ERROR_UNKNOWN;
    char line[4352];
    nvmlReturn_t answer = NVML_ERROR_NOT_FOUND;
    while (fgets(line, sizeof line, table) != NULL) {
        char path[4096], what[32];
        unsigned long long hard, used;
        int fields = sscanf(line, "%4095s %31s %llu %llu", path, what, &hard, &used);
        if (fields < 2 || strcmp(path, limits->nameSpace) != 0) continue;
        if (strcmp(what, "NOT_FOUND") == 0) {
            answer = NVML_ERROR_NOT_FOUND;
        } else if (strcmp(what, "NOT_SUPPORTED") == 0) {
            answer = NVML_ERROR_NOT_SUPPORTED;
        } else if (strcmp(what, "LAYOUT") == 0) {
            limits->softLimit = offsetof(nvmlGetMemoryLimits_v1_t, softLimit);
            limits->hardLimit = offsetof(nvmlGetMemoryLimits_v1_t, hardLimit);
            limits->currentUsed = sizeof(nvmlGetMemoryLimits_v1_t);
            answer = NVML_SUCCESS;
        } else if (strcmp(what, "INITS") == 0) {
            limits->softLimit = 0;
            limits->hardLimit = 0;
            limits->currentUsed = (unsigned long long)initialised;
            answer = NVML_SUCCESS;
        } else if (fields == 4) {
            limits->softLimit = strtoull(what, NULL, 10);
            limits->hardLimit = hard;
            limits->currentUsed = used;
            answer = NVML_SUCCESS;
        } else if (strcmp(what, "DENY") == 0) {
            answer = NVML_ERROR_NOT_FOUND;
        } else {
            answer = NVML_ERROR_UNKNOWN;
        }
    }
    fclose(table);
    return answer;
}

nvmlReturn_t nvmlDeviceSetMemoryLimits_v1(nvmlDevice_t device, nvmlSetMemoryLimits_v1_t *limits) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (device != &the_gpu || limits == NULL || limits->nameSpace == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (limits->softLimit > limits->hardLimit) return NVML_ERROR_INVALID_ARGUMENT;
    FILE *table = open_table();
    if (table == NULL) return NVML_ERROR_UNKNOWN;
    char line[4352], last[32] = "";
    unsigned long long used = 0;
    while (fgets(line, sizeof line, table) != NULL) {
        char path[4096], what[32];
        unsigned long long hard, now;
        int fields = sscanf(line, "%4095s %31s %llu %llu", path, what, &hard, &now);
        if (fields < 2 || strcmp(path, limits->nameSpace) != 0) continue;
        strcpy(last, what);
        if (fields == 4) used = now;
    }
    fclose(table);
    if (strcmp(last, "NOT_SUPPORTED") == 0) return NVML_ERROR_NOT_SUPPORTED;
    if (strcmp(last, "DENY") == 0) return NVML_ERROR_NO_PERMISSION;
    unsigned long long soft = limits->softLimit, hard = limits->hardLimit;
    if (strcmp(last, "LAYOUT") == 0) {
        soft = offsetof(nvmlSetMemoryLimits_v1_t, softLimit);
        hard = offsetof(nvmlSetMemoryLimits_v1_t, hardLimit);
        used = sizeof(nvmlSetMemoryLimits_v1_t);
    }
    Dl_info info;
    char path[4096];
    if (dladdr((void *)&nvmlDeviceSetMemoryLimits_v1, &info) == 0 || info.dli_fname == NULL) return NVML_ERROR_UNKNOWN;
    if (snprintf(path, sizeof path, "%s.table", info.dli_fname) >= (int)sizeof path) return NVML_ERROR_UNKNOWN;
    FILE *out = fopen(path, "a");
    if (out == NULL) return NVML_ERROR_UNKNOWN;
    fprintf(out, "%s %llu %llu %llu\n", limits->nameSpace, soft, hard, used);
    fclose(out);
    return NVML_SUCCESS;
}
#endif
