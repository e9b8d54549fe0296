//! The [`DeviceCommunicator`] impl: each collective enqueued on the communicator's stream
//! under its lock, with the device's context bound; a returned error means nothing was
//! enqueued.

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use cudarc::driver::CudaStream;

use super::library::ReduceFn;
use super::lifecycle::Lifecycle;
use super::NcclCommunicator;
use crate::device::{DeviceArgs, DeviceCommunicator, DeviceElement};
use crate::error::{Op, Result, TransportError};

impl NcclCommunicator {
    /// Enqueues one reduction (`ncclAllReduce` or `ncclReduceScatter`).
    fn reduce<T: DeviceElement>(
        &self,
        op: Op,
        call: &'static str,
        f: ReduceFn,
        mut args: DeviceArgs<'_, T>,
    ) -> Result<()> {
        args.group().expect(op, self.rank(), self.size())?;
        let _state = self.enter(op)?;
        let (count, reduce) = (args.count(), args.reduce().nccl());
        let (send, recv) = args.buffers();
        let (dst, _record_dst) = recv.device_ptr_mut(&self.stream);
        let (src, _record_src) = match send {
            Some(send) => {
                let (src, record) = send.device_ptr(&self.stream);
                (src, Some(record))
            }
            None => (dst, None),
        };
        // SAFETY: `src` and `dst` are device pointers of live buffers on this communicator's
        // device, checked to hold the element counts NCCL derives from `count` (see
        // `DeviceArgs`); `T::NCCL_TYPE` has `T`'s size; the buffers are borrowed (and cudarc
        // records their use on the stream) until the call is enqueued, and cudarc's events
        // keep later accesses ordered after it; `comm` is live under the lock.
        let code = unsafe {
            f(
                src as usize as *const c_void,
                dst as usize as *mut c_void,
                count,
                T::NCCL_TYPE,
                reduce,
                self.comm,
                self.cu_stream(),
            )
        };
        self.lib.check(op, call, code, self.comm)
    }
}

impl DeviceCommunicator for NcclCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn device_ordinal(&self) -> usize {
        self.ordinal
    }

    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn backend_name(&self) -> &'static str {
        "nccl"
    }

    fn synchronize(&self) -> Result<()> {
        let mut state = self.lock();
        if let Lifecycle::Aborted(reason) = &*state {
            return Err(self.aborted(Op::Barrier, reason));
        }
        self.bind(Op::Barrier)?;
        self.drain(&mut state, Op::Barrier)?;
        let checked = self.async_error(Op::Barrier);
        if let Err(e @ TransportError::Nccl { .. }) = &checked {
            self.abort(&mut state, e.to_string());
        }
        checked
    }

    fn raw_all_reduce<T: DeviceElement>(&self, args: DeviceArgs<'_, T>) -> Result<()> {
        self.reduce(Op::AllReduce, "ncclAllReduce", self.lib.all_reduce, args)
    }

    fn raw_reduce_scatter<T: DeviceElement>(&self, args: DeviceArgs<'_, T>) -> Result<()> {
        self.reduce(
            Op::ReduceScatter,
            "ncclReduceScatter",
            self.lib.reduce_scatter,
            args,
        )
    }

    fn raw_all_gather<T: DeviceElement>(&self, mut args: DeviceArgs<'_, T>) -> Result<()> {
        args.group()
            .expect(Op::AllGather, self.rank(), self.size())?;
        let _state = self.enter(Op::AllGather)?;
        let count = args.count();
        let (send, recv) = args.buffers();
        let Some(send) = send else {
            return Err(TransportError::Setup(
                "all_gather needs a send buffer (internal error)".into(),
            ));
        };
        let (dst, _record_dst) = recv.device_ptr_mut(&self.stream);
        let (src, _record_src) = send.device_ptr(&self.stream);
        // SAFETY: as in `reduce`: live buffers on this device, `send` holds `count` and
        // `recv` `size * count` elements of `T` (checked), `comm` is live under the lock.
        let code = unsafe {
            (self.lib.all_gather)(
                src as usize as *const c_void,
                dst as usize as *mut c_void,
                count,
                T::NCCL_TYPE,
                self.comm,
                self.cu_stream(),
            )
        };
        self.lib
            .check(Op::AllGather, "ncclAllGather", code, self.comm)
    }

    fn raw_broadcast<T: DeviceElement>(&self, mut args: DeviceArgs<'_, T>) -> Result<()> {
        args.group()
            .expect(Op::Broadcast, self.rank(), self.size())?;
        let _state = self.enter(Op::Broadcast)?;
        let (count, root) = (args.count(), args.root());
        let root = c_int::try_from(root)
            .map_err(|_| TransportError::Setup(format!("root {root} does not fit NCCL's int")))?;
        let (_, buf) = args.buffers();
        let (ptr, _record) = buf.device_ptr_mut(&self.stream);
        // SAFETY: as in `reduce`: a live buffer of `count` elements of `T` on this device,
        // used in place (NCCL allows send == recv); `root` is a rank; `comm` is live.
        let code = unsafe {
            (self.lib.broadcast)(
                ptr as usize as *const c_void,
                ptr as usize as *mut c_void,
                count,
                T::NCCL_TYPE,
                root,
                self.comm,
                self.cu_stream(),
            )
        };
        self.lib
            .check(Op::Broadcast, "ncclBroadcast", code, self.comm)
    }
}
