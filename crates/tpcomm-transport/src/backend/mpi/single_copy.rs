//! Turning off Open MPI's shared-memory single-copy mechanism and the TCP transport's RDMA
//! before `MPI_Init`, through the MPI tool interface: what protects receive buffers from a
//! peer sending more than agreed.

use std::ffi::c_int;
use std::ptr;

use mpi::ffi;

use super::conv::check_before_init;
use super::process_state::lock_mpi;
use super::MpiCommunicator;
use crate::error::{Op, Result, TransportError};

impl MpiCommunicator {
    /// Turns off Open MPI's shared-memory single-copy mechanism (CMA, XPMEM or KNEM) for
    /// this process, so that messages between ranks on one host go through shared-memory
    /// fragments that MPI copies into the receive buffer *bounded by its length*. Call it
    /// on every rank, before MPI is initialized (before `mpi::initialize()`); it sets the
    /// control variable `btl_vader_single_copy_mechanism` to `none` through the MPI tool
    /// interface (`MPI_T`), the same as `mpirun --mca btl_vader_single_copy_mechanism none`,
    /// and leaves the tool interface initialized (finalizing it before `MPI_Init` undoes
    /// the setting in Open MPI 4.1).
    ///
    /// Why: with single copy, Open MPI 4.1 moves a message above its eager limit (4 KiB)
    /// with one copy of the *sender's* length, even into a smaller receive buffer: a peer
    /// that sends more than was agreed overwrites the receiver's memory past the buffer.
    /// On the blocking path collectives receive into the caller's buffers, which tpcomm
    /// cannot guard (the timed path of [`with_timeout`](Self::with_timeout) receives into
    /// guarded buffers of its own). Without single copy, such a message is reported as
    /// `MPI_ERR_TRUNCATE` and nothing past the buffer is written. The cost is bandwidth:
    /// large messages between ranks of one host are copied twice.
    ///
    /// The same holds across hosts: Open MPI 4.1's TCP transport writes the RDMA fragments
    /// of a large message at the sender's length (a peer on another host that sends more
    /// than agreed overruns the receive buffer, and on the timed path reaches its guard
    /// page: the process is killed by SIGSEGV). This call therefore also clears the put and
    /// get flags of `btl_tcp_flags` (it sets `OMPI_MCA_btl_tcp_flags`, as `--mca
    /// btl_tcp_flags send,inplace,...` would, before the tool interface reads it, and checks
    /// the value), so that TCP messages arrive in fragments bounded by the receive buffer
    /// and an oversized one is `MPI_ERR_TRUNCATE`. Setting an environment variable is not
    /// safe while other threads read the environment: call this before starting threads.
    /// Where the library has no TCP transport that part is skipped.
    ///
    /// Every rank must agree: a rank with single copy turned off that receives from a rank
    /// that still uses it aborts (`pml_ob1_recvreq.c: invalid bml for rdma get`).
    ///
    /// Fails with [`TransportError::Setup`] when MPI is already initialized, and with
    /// [`TransportError::Unsupported`] when the MPI library has no such variable (it is
    /// Open MPI 4.x's; MPICH and Open MPI 5 have none).
    pub fn disable_single_copy_before_init() -> Result<()> {
        let op = Op::Setup;
        let _guard = lock_mpi();
        let mut initialized: c_int = 0;
        // SAFETY: MPI_Initialized may be called at any time; `initialized` is a valid place
        // for one int.
        let code = unsafe { ffi::MPI_Initialized(&mut initialized) };
        check_before_init(op, "MPI_Initialized", code)?;
        if initialized != 0 {
            return Err(TransportError::Setup(
                "the single-copy mechanism can only be disabled before MPI is initialized".into(),
            ));
        }
        // Open MPI refuses to write the TCP transport's flags through MPI_T (they are set
        // once): its environment variable is read when the variable is registered, at the
        // first `MPI_T_init_thread` or `MPI_Init` of the process; checked below.
        std::env::set_var(TCP_FLAGS_ENV, TCP_FLAGS_WITHOUT_RDMA);
        let mut provided: c_int = 0;
        // SAFETY: the tool interface may be initialized before MPI_Init, any number of
        // times; `provided` is a valid place for one int. Reading an immutable constant
        // exported by rsmpi's C shim.
        let code = unsafe { ffi::MPI_T_init_thread(ffi::RSMPI_THREAD_SINGLE, &mut provided) };
        check_before_init(op, "MPI_T_init_thread", code)?;
        let mut index: c_int = 0;
        // SAFETY: MPI_T is initialized; the name is a NUL-terminated string; `index` is a
        // valid place for one int.
        let code = unsafe { ffi::MPI_T_cvar_get_index(SINGLE_COPY_CVAR.as_ptr(), &mut index) };
        if code == ffi::MPI_T_ERR_INVALID_NAME as c_int {
            return Err(TransportError::Unsupported {
                op,
                reason: format!(
                    "this MPI library has no control variable {SINGLE_COPY_CVAR:?} (Open MPI \
                     4.x's shared-memory transport)"
                ),
            });
        }
        check_before_init(op, "MPI_T_cvar_get_index", code)?;
        let none = single_copy_value(op, index, "none")?;
        update_cvar(op, index, SINGLE_COPY_CVAR, |_| none)?;
        // The TCP transport: without RDMA put and get, a message to a rank on another host
        // is received in fragments bounded by the receive buffer too.
        let mut tcp: c_int = 0;
        // SAFETY: MPI_T is initialized; the name is a NUL-terminated string; `tcp` is a
        // valid place for one int.
        let code = unsafe { ffi::MPI_T_cvar_get_index(TCP_FLAGS_CVAR.as_ptr(), &mut tcp) };
        if code == ffi::MPI_T_ERR_INVALID_NAME as c_int {
            tracing::debug!("no TCP transport: only single copy disabled");
        } else {
            check_before_init(op, "MPI_T_cvar_get_index", code)?;
            let flags = read_cvar(op, tcp, TCP_FLAGS_CVAR)?;
            if flags & (TCP_FLAG_PUT | TCP_FLAG_GET) != 0 {
                return Err(TransportError::Setup(format!(
                    "{TCP_FLAGS_CVAR:?} still allows RDMA ({flags:#x}): the tool interface \
                     was initialized before {TCP_FLAGS_ENV} was set"
                )));
            }
        }
        tracing::debug!("shared-memory single copy disabled before MPI_Init");
        Ok(())
    }
}

/// Open MPI 4.x's control variable selecting the shared-memory single-copy mechanism.
const SINGLE_COPY_CVAR: &std::ffi::CStr = c"btl_vader_single_copy_mechanism";

/// Open MPI 4.x's control variable of the TCP transport's capabilities (bit flags), its
/// environment variable, and the value without put and get (its default otherwise).
const TCP_FLAGS_CVAR: &std::ffi::CStr = c"btl_tcp_flags";
const TCP_FLAGS_ENV: &str = "OMPI_MCA_btl_tcp_flags";
const TCP_FLAGS_WITHOUT_RDMA: &str = "send,inplace,need-ack,need-csum,hetero-rdma";
/// `MCA_BTL_FLAGS_PUT` and `MCA_BTL_FLAGS_GET` of Open MPI's `btl.h`: RDMA writes and reads.
const TCP_FLAG_PUT: c_int = 0x2;
const TCP_FLAG_GET: c_int = 0x4;

/// Runs `f` on a handle of the one-value control variable `index` (`name`), then frees it.
fn with_cvar<T>(
    op: Op,
    index: c_int,
    name: &std::ffi::CStr,
    f: impl FnOnce(ffi::MPI_T_cvar_handle) -> Result<T>,
) -> Result<T> {
    let mut handle = std::mem::MaybeUninit::<ffi::MPI_T_cvar_handle>::uninit();
    let mut count: c_int = 0;
    // SAFETY: `index` names a control variable (looked up by the caller); it is not bound
    // to an MPI object, so the object handle is null; `handle` and `count` are valid places.
    let code = unsafe {
        ffi::MPI_T_cvar_handle_alloc(index, ptr::null_mut(), handle.as_mut_ptr(), &mut count)
    };
    check_before_init(op, "MPI_T_cvar_handle_alloc", code)?;
    // SAFETY: MPI_T_cvar_handle_alloc succeeded, so it wrote the handle.
    let mut handle = unsafe { handle.assume_init() };
    let done = if count == 1 {
        f(handle)
    } else {
        Err(TransportError::Setup(format!(
            "{name:?} holds {count} values, expected one"
        )))
    };
    // SAFETY: `handle` was allocated above and is not used after this call.
    let code = unsafe { ffi::MPI_T_cvar_handle_free(&mut handle) };
    let done = done?;
    check_before_init(op, "MPI_T_cvar_handle_free", code)?;
    Ok(done)
}

/// The value of the one-value control variable behind `handle`.
fn read_value(op: Op, handle: ffi::MPI_T_cvar_handle) -> Result<c_int> {
    let mut read = CvarValue::new(-1);
    // SAFETY: `handle` is a live handle of a variable holding one scalar of at most 16 bytes
    // (an `int` or `unsigned int` in Open MPI, checked by `with_cvar`); `read` is 16
    // writable bytes.
    let code = unsafe { ffi::MPI_T_cvar_read(handle, (&mut read as *mut CvarValue).cast()) };
    check_before_init(op, "MPI_T_cvar_read", code).map(|()| read.0[0])
}

/// Reads the one-`int` control variable `index` (`name`).
fn read_cvar(op: Op, index: c_int, name: &std::ffi::CStr) -> Result<c_int> {
    with_cvar(op, index, name, |handle| read_value(op, handle))
}

/// Reads the one-`int` control variable `index` (`name`), writes `new(value)` and checks
/// that it reads back.
fn update_cvar(
    op: Op,
    index: c_int,
    name: &std::ffi::CStr,
    new: impl FnOnce(c_int) -> c_int,
) -> Result<()> {
    with_cvar(op, index, name, |handle| {
        let wanted = new(read_value(op, handle)?);
        let value = CvarValue::new(wanted);
        // SAFETY: as in `read_value`; `value` is 16 readable bytes.
        let code = unsafe { ffi::MPI_T_cvar_write(handle, (&value as *const CvarValue).cast()) };
        check_before_init(op, "MPI_T_cvar_write", code)?;
        let now = read_value(op, handle)?;
        if now == wanted {
            Ok(())
        } else {
            Err(TransportError::Setup(format!(
                "{name:?} reads {now} after writing {wanted}"
            )))
        }
    })
}

/// One control-variable value: an `int` in its first four bytes, zero-padded to 16 bytes.
#[repr(C, align(16))]
struct CvarValue([c_int; 4]);

impl CvarValue {
    fn new(value: c_int) -> Self {
        Self([value, 0, 0, 0])
    }
}

/// The integer value of the enumeration item `wanted` of control variable `index` (an
/// enumerated `int`, as Open MPI declares `btl_vader_single_copy_mechanism`).
fn single_copy_value(op: Op, index: c_int, wanted: &str) -> Result<c_int> {
    let mut name = [0u8; 256];
    let mut name_len = name.len() as c_int;
    let mut desc = [0u8; 1024];
    let mut desc_len = desc.len() as c_int;
    let (mut verbosity, mut bind, mut scope): (c_int, c_int, c_int) = (0, 0, 0);
    // The datatype is not checked: MPI_Type_size may not be called before MPI_Init. Open
    // MPI declares the variable an enumerated `int`; reads and writes go through a
    // zero-padded `CvarValue`, so that even a wider scalar stays in bounds.
    let mut datatype = std::mem::MaybeUninit::<ffi::MPI_Datatype>::uninit();
    let mut enumtype = std::mem::MaybeUninit::<ffi::MPI_T_enum>::uninit();
    // SAFETY: MPI_T is initialized and `index` is a valid control variable; the name and
    // description buffers hold `name_len` and `desc_len` bytes; every other argument is a
    // valid place for one value.
    let code = unsafe {
        ffi::MPI_T_cvar_get_info(
            index,
            name.as_mut_ptr().cast(),
            &mut name_len,
            &mut verbosity,
            datatype.as_mut_ptr(),
            enumtype.as_mut_ptr(),
            desc.as_mut_ptr().cast(),
            &mut desc_len,
            &mut bind,
            &mut scope,
        )
    };
    check_before_init(op, "MPI_T_cvar_get_info", code)?;
    // SAFETY: MPI_T_cvar_get_info succeeded, so it wrote the enumeration handle.
    let enumtype = unsafe { enumtype.assume_init() };
    let mut items: c_int = 0;
    let mut enum_name = [0u8; 256];
    let mut enum_name_len = enum_name.len() as c_int;
    // SAFETY: `enumtype` was returned for this variable; the buffer holds
    // `enum_name_len` bytes; `items` is a valid place for one int.
    let code = unsafe {
        ffi::MPI_T_enum_get_info(
            enumtype,
            &mut items,
            enum_name.as_mut_ptr().cast(),
            &mut enum_name_len,
        )
    };
    check_before_init(op, "MPI_T_enum_get_info", code)?;
    let mut names = Vec::new();
    for item in 0..items {
        let mut value: c_int = 0;
        let mut item_name = [0u8; 256];
        let mut item_len = item_name.len() as c_int;
        // SAFETY: `item < items`; the buffer holds `item_len` bytes; `value` is a valid
        // place for one int.
        let code = unsafe {
            ffi::MPI_T_enum_get_item(
                enumtype,
                item,
                &mut value,
                item_name.as_mut_ptr().cast(),
                &mut item_len,
            )
        };
        check_before_init(op, "MPI_T_enum_get_item", code)?;
        let text = item_name.split(|&b| b == 0).next().unwrap_or_default();
        let text = String::from_utf8_lossy(text).into_owned();
        if text == wanted {
            return Ok(value);
        }
        names.push(text);
    }
    Err(TransportError::Setup(format!(
        "{SINGLE_COPY_CVAR:?} has no value {wanted:?} (it has {names:?})"
    )))
}
