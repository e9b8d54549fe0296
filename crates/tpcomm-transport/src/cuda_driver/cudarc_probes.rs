//! The named lists of driver functions that a layer calls through cudarc (its safe API or
//! its `driver::sys` bindings), which that layer probes with
//! [`missing_symbols`](super::missing_symbols) before its first cudarc call: cudarc's lazy
//! loader panics on a missing function, the probe makes it a typed error naming them. One
//! list per layer, kept here so that the driver functions tpcomm depends on are listed in
//! one place; every function below exists in drivers of CUDA 11.4 and newer.

/// What the NCCL transport (`tpcomm_transport::NcclCommunicator`) calls through cudarc's
/// safe driver API: context, stream, events, synchronization.
pub const NCCL_TRANSPORT: &[&str] = &[
    "cuGetErrorName",
    "cuGetErrorString",
    "cuInit",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuStreamCreate",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventRecord",
];

/// What `tpcomm-ipc`'s legacy CUDA IPC backend calls through cudarc's `driver::sys` (its
/// `result` layer: contexts, allocations, pointer attributes, IPC handles, copies).
pub const LEGACY_IPC: &[&str] = &[
    "cuGetErrorName",
    "cuGetErrorString",
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuCtxSynchronize",
    "cuStreamSynchronize",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemsetD8_v2",
    "cuMemGetAddressRange_v2",
    "cuPointerGetAttribute",
    "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuCtxEnablePeerAccess",
];

/// What `tpcomm-ipc`'s address reservations (`CudaMemory::hold_address`) call through
/// cudarc's `driver::sys`, probed when the first one is made.
pub const ADDRESS_RESERVATION: &[&str] = &["cuMemAddressReserve", "cuMemAddressFree"];

/// What the all-reduce's CUDA backend (`tpcomm-allreduce`) and the cudarc calls it makes
/// use: modules and launches, async copies, streams and their capture, graphs, device
/// attributes and peer access, events.
pub const ALL_REDUCE: &[&str] = &[
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuLaunchKernel",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuMemsetD8Async",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamIsCapturing",
    "cuStreamBeginCapture_v2",
    "cuStreamEndCapture",
    "cuGraphInstantiateWithFlags",
    "cuGraphLaunch",
    "cuGraphExecDestroy",
    "cuGraphDestroy",
    "cuDeviceGetAttribute",
    "cuDeviceCanAccessPeer",
    "cuDeviceGetUuid_v2",
    "cuCtxGetCurrent",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuEventElapsedTime_v2",
    "cuEventDestroy_v2",
];
