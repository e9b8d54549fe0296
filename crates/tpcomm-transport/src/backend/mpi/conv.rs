//! Conversions between this crate's values and MPI's: return codes to [`TransportError::Mpi`]
//! (with the code's class and text), element types and reductions to MPI's predefined
//! handles.

use std::ffi::c_int;

use mpi::ffi;

use crate::error::{Op, Result, TransportError};
use crate::reduce::{DataType, ReduceOp};

/// The MPI standard fixes `MPI_SUCCESS` to 0; its binding's integer type differs between
/// implementations, so compare against a `c_int` constant checked here at compile time.
pub(super) const MPI_SUCCESS: c_int = 0;
const _: () = assert!(ffi::MPI_SUCCESS == 0);

/// Length of the buffer `MPI_Error_string` writes into.
const ERROR_STRING_LEN: usize = ffi::MPI_MAX_ERROR_STRING as usize;

/// `MPI_COMM_NULL`.
pub(super) fn comm_null() -> ffi::MPI_Comm {
    // SAFETY: reading an immutable handle constant exported by rsmpi's C shim.
    unsafe { ffi::RSMPI_COMM_NULL }
}

/// The predefined MPI type of an element type (`f16` and `bf16`, which MPI lacks, travel
/// widened as [`float_type`]; they map to it here too).
pub(super) fn mpi_type(dtype: DataType) -> ffi::MPI_Datatype {
    // SAFETY: reading immutable handle constants exported by rsmpi's C shim.
    unsafe {
        match dtype {
            DataType::I8 => ffi::RSMPI_INT8_T,
            DataType::U8 => ffi::RSMPI_UINT8_T,
            DataType::I16 => ffi::RSMPI_INT16_T,
            DataType::U16 => ffi::RSMPI_UINT16_T,
            DataType::I32 => ffi::RSMPI_INT32_T,
            DataType::U32 => ffi::RSMPI_UINT32_T,
            DataType::I64 => ffi::RSMPI_INT64_T,
            DataType::U64 => ffi::RSMPI_UINT64_T,
            DataType::F16 | DataType::Bf16 | DataType::F32 => ffi::RSMPI_FLOAT,
            DataType::F64 => ffi::RSMPI_DOUBLE,
        }
    }
}

/// `MPI_FLOAT`.
pub(super) fn float_type() -> ffi::MPI_Datatype {
    // SAFETY: reading an immutable handle constant exported by rsmpi's C shim.
    unsafe { ffi::RSMPI_FLOAT }
}

/// The predefined MPI reduction of a [`ReduceOp`].
pub(super) fn reduce_op(op: ReduceOp) -> ffi::MPI_Op {
    // SAFETY: reading immutable handle constants exported by rsmpi's C shim.
    unsafe {
        match op {
            ReduceOp::Sum => ffi::RSMPI_SUM,
            ReduceOp::Prod => ffi::RSMPI_PROD,
            ReduceOp::Max => ffi::RSMPI_MAX,
            ReduceOp::Min => ffi::RSMPI_MIN,
        }
    }
}

/// The one-byte datatype bytes travel as (`MPI_UINT8_T`).
pub(super) fn byte_type() -> ffi::MPI_Datatype {
    // SAFETY: reading an immutable handle constant exported by rsmpi's C shim.
    unsafe { ffi::RSMPI_UINT8_T }
}

/// Maps a return code to `Ok` or to [`TransportError::Mpi`]; inline, so that success
/// costs one comparison after each MPI call.
#[inline(always)]
pub(super) fn check(op: Op, call: &'static str, code: c_int) -> Result<()> {
    if code == MPI_SUCCESS {
        Ok(())
    } else {
        Err(mpi_error(op, call, code))
    }
}

/// [`check`] for calls made before `MPI_Init` (the tool interface): Open MPI 4.1 aborts the
/// process when `MPI_Error_class` or `MPI_Error_string` is called before `MPI_Init`, so the
/// code is kept without a class (`-1`) or a description from MPI.
pub(super) fn check_before_init(op: Op, call: &'static str, code: c_int) -> Result<()> {
    if code == MPI_SUCCESS {
        Ok(())
    } else {
        Err(TransportError::Mpi {
            op,
            call,
            code,
            class: -1,
            message: "not described (MPI is not initialized)".into(),
        })
    }
}

/// Builds [`TransportError::Mpi`] from a failed call's code, with its class and text (off
/// the hot path).
#[cold]
#[inline(never)]
pub(super) fn mpi_error(op: Op, call: &'static str, code: c_int) -> TransportError {
    let mut class: c_int = -1;
    // SAFETY: `code` was returned by MPI (so MPI is initialized); `class` is a valid place
    // for one int. MPI_Error_class may be called at any thread level for a valid code.
    let rc = unsafe { ffi::MPI_Error_class(code, &mut class) };
    if rc != MPI_SUCCESS {
        class = -1;
    }
    TransportError::Mpi {
        op,
        call,
        code,
        class,
        message: error_string(code),
    }
}

/// `MPI_Error_string` of `code`, or a note when MPI cannot describe it.
fn error_string(code: c_int) -> String {
    let mut buf = [0u8; ERROR_STRING_LEN];
    let mut len: c_int = 0;
    // SAFETY: `buf` holds MPI_MAX_ERROR_STRING bytes, as MPI_Error_string requires, and
    // `len` is a valid place for one int.
    let rc = unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr().cast(), &mut len) };
    if rc != MPI_SUCCESS {
        return format!("no description (MPI_Error_string failed with code {rc})");
    }
    let len = usize::try_from(len).unwrap_or(0).min(buf.len());
    let text = &buf[..len];
    let text = text.split(|&b| b == 0).next().unwrap_or_default();
    String::from_utf8_lossy(text).trim_end().to_owned()
}
