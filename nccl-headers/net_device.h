/* librustnet: device-offload types shared by ncclNet v7 and later. */
#ifndef RUSTNET_NCCL_NET_DEVICE_H
#define RUSTNET_NCCL_NET_DEVICE_H
#include <stddef.h>

#define NCCL_NET_DEVICE_INVALID_VERSION 0x0
#define NCCL_NET_DEVICE_UNPACK_VERSION 0x7
#define NCCL_NET_MTU_SIZE 4096

typedef enum {
  NCCL_NET_DEVICE_HOST = 0,
  NCCL_NET_DEVICE_UNPACK = 1
} ncclNetDeviceType;

typedef struct {
  ncclNetDeviceType netDeviceType; /* HOST for a host plugin */
  int netDeviceVersion;            /* NCCL_NET_DEVICE_INVALID_VERSION for a host plugin */
  void* handle;
  size_t size;
  int needsProxyProgress;
} ncclNetDeviceHandle_v7_t;

typedef ncclNetDeviceHandle_v7_t ncclNetDeviceHandle_v8_t;
typedef ncclNetDeviceHandle_v7_t ncclNetDeviceHandle_v9_t;
typedef ncclNetDeviceHandle_v7_t ncclNetDeviceHandle_v10_t;
typedef ncclNetDeviceHandle_v7_t ncclNetDeviceHandle_v11_t;
typedef ncclNetDeviceHandle_v7_t ncclNetDeviceHandle_v12_t;
#endif
