/* librustnet: ncclNet v6 (first loaded by NCCL 2.13; the only version 2.18 knows). */
#ifndef RUSTNET_NCCL_NET_V6_H
#define RUSTNET_NCCL_NET_V6_H
#include "err.h"

typedef struct {
  char* name;      /* used in logs and as the topology key: unique per device */
  char* pciPath;   /* sysfs PCI directory of the NIC, or NULL for a virtual one */
  uint64_t guid;   /* NIC identity; equal guid+port means the same physical port */
  int ptrSupport;  /* NCCL_PTR_HOST | NCCL_PTR_CUDA | NCCL_PTR_DMABUF */
  int speed;       /* Mbps */
  int port;
  float latency;   /* microseconds */
  int maxComms;
  int maxRecvs;    /* largest n of a grouped irecv */
} ncclNetProperties_v6_t;

typedef struct {
  const char* name;
  ncclResult_t (*init)(ncclDebugLogger_t logFunction);
  ncclResult_t (*devices)(int* ndev);
  ncclResult_t (*getProperties)(int dev, ncclNetProperties_v6_t* props);
  ncclResult_t (*listen)(int dev, void* handle, void** listenComm);
  ncclResult_t (*connect)(int dev, void* handle, void** sendComm);
  ncclResult_t (*accept)(void* listenComm, void** recvComm);
  ncclResult_t (*regMr)(void* comm, void* data, int size, int type, void** mhandle);
  ncclResult_t (*regMrDmaBuf)(void* comm, void* data, size_t size, int type, uint64_t offset, int fd, void** mhandle);
  ncclResult_t (*deregMr)(void* comm, void* mhandle);
  ncclResult_t (*isend)(void* sendComm, void* data, int size, int tag, void* mhandle, void** request);
  ncclResult_t (*irecv)(void* recvComm, int n, void** data, int* sizes, int* tags, void** mhandles, void** request);
  ncclResult_t (*iflush)(void* recvComm, int n, void** data, int* sizes, void** mhandles, void** request);
  ncclResult_t (*test)(void* request, int* done, int* sizes);
  ncclResult_t (*closeSend)(void* sendComm);
  ncclResult_t (*closeRecv)(void* recvComm);
  ncclResult_t (*closeListen)(void* listenComm);
} ncclNet_v6_t;
#endif
