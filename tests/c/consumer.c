/* A C consumer of librustnet, compiled against our own nccl-headers/ by
 * tests/c_consumer.rs: proves the headers and the exported tables agree from
 * the C side, and that log lines reach the logger NCCL passes to init. */
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "nccl_net.h"

static int warns = 0, infos = 0;
static char last_warn[4096];

static void logger(ncclDebugLogLevel level, unsigned long flags, const char* file, int line, const char* fmt, ...) {
  char buf[4096];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  printf("LOG level=%d flags=%lu %s:%d %s\n", (int)level, flags, file ? file : "?", line, buf);
  if (level == NCCL_LOG_WARN) { warns++; snprintf(last_warn, sizeof last_warn, "%s", buf); }
  if (level == NCCL_LOG_INFO) infos++;
}

int main(int argc, char** argv) {
  if (argc < 3) { fprintf(stderr, "usage: consumer LIB MODE\n"); return 2; }
  void* h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!h) { printf("FAIL dlopen %s\n", dlerror()); return 1; }
  if (strcmp(argv[2], "props") == 0) {
    ncclNet_v8_t* v8 = (ncclNet_v8_t*)dlsym(h, "ncclNetPlugin_v8");
    ncclNet_v9_t* v9 = (ncclNet_v9_t*)dlsym(h, "ncclNetPlugin_v9");
    ncclNet_v6_t* v6 = (ncclNet_v6_t*)dlsym(h, "ncclNetPlugin_v6");
    if (!v8 || !v9 || !v6) { printf("FAIL missing symbols\n"); return 1; }
    if (v8->init(logger) != ncclSuccess) { printf("FAIL init\n"); return 1; }
    int n = 0;
    if (v8->devices(&n) != ncclSuccess || n < 1) { printf("FAIL devices %d\n", n); return 1; }
    ncclNetProperties_v8_t p8; memset(&p8, 0xab, sizeof p8);
    ncclNetProperties_v9_t p9; memset(&p9, 0xab, sizeof p9);
    ncclNetProperties_v6_t p6; memset(&p6, 0xab, sizeof p6);
    if (v8->getProperties(0, &p8) || v9->getProperties(0, &p9) || v6->getProperties(0, &p6)) { printf("FAIL getProperties\n"); return 1; }
    printf("V8 name=%s ptr=%d regIsGlobal=%d speed=%d maxComms=%d maxRecvs=%d type=%d ver=%d\n", p8.name, p8.ptrSupport,
           p8.regIsGlobal, p8.speed, p8.maxComms, p8.maxRecvs, (int)p8.netDeviceType, p8.netDeviceVersion);
    printf("V9 name=%s forceFlush=%d maxRecvs=%d vndevs=%d vdev0=%d maxP2p=%zu maxColl=%zu\n", p9.name, p9.forceFlush,
           p9.maxRecvs, p9.vProps.ndevs, p9.vProps.devs[0], p9.maxP2pBytes, p9.maxCollBytes);
    printf("V6 name=%s maxRecvs=%d\n", p6.name, p6.maxRecvs);
    /* v11/v12: a context per communicator, properties with maxMultiRequestSize (and rail/plane) */
    ncclNet_v11_t* v11 = (ncclNet_v11_t*)dlsym(h, "ncclNetPlugin_v11");
    ncclNet_v12_t* v12 = (ncclNet_v12_t*)dlsym(h, "ncclNetPlugin_v12");
    if (!v11 || !v12) { printf("FAIL missing v11/v12 symbols\n"); return 1; }
    ncclNetCommConfig_v11_t cfg = { 96 };
    void* ctx = NULL;
    if (v12->init(&ctx, 0x1234, &cfg, logger, NULL) != ncclSuccess || !ctx) { printf("FAIL v12 init\n"); return 1; }
    ncclNetProperties_v11_t p11; memset(&p11, 0xab, sizeof p11);
    ncclNetProperties_v12_t p12; memset(&p12, 0xab, sizeof p12);
    if (v11->getProperties(0, &p11) || v12->getProperties(0, &p12)) { printf("FAIL v11/v12 getProperties\n"); return 1; }
    printf("V11 name=%s vndevs=%d maxP2p=%zu maxColl=%zu maxMultiRequestSize=%d\n", p11.name, p11.vProps.ndevs, p11.maxP2pBytes,
           p11.maxCollBytes, p11.maxMultiRequestSize);
    printf("V12 name=%s vndevs=%d vdev0=%d maxP2p=%zu maxMultiRequestSize=%d railId=%d planeId=%d\n", p12.name, p12.vProps.ndevs,
           p12.vProps.devs[0], p12.maxP2pBytes, p12.maxMultiRequestSize, (int)p12.railId, (int)p12.planeId);
    printf("FINALIZE %d\n", (int)v12->finalize(ctx));
    printf("INFOS %d WARNS %d\n", infos, warns);
    return 0;
  }
  if (strcmp(argv[2], "badenv") == 0) {
    ncclNet_v10_t* v10 = (ncclNet_v10_t*)dlsym(h, "ncclNetPlugin_v10");
    ncclResult_t r = v10->init(logger, NULL);
    printf("INIT %d WARNS %d LASTWARN %s\n", (int)r, warns, last_warn);
    return 0;
  }
  return 2;
}
