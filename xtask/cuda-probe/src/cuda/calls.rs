//! The record of one operation's calls: each driver call, system call, check and note with
//! its result code and name, as the parent prints them and the JSON keeps them.

use std::ffi::c_int;

use cudarc::driver::sys;
use tpcomm_transport::cuda_driver::error_strings;

use super::entry_points::name_of;
use crate::protocol::Call;

/// The calls of one operation, recorded as they are made.
pub(super) struct Calls<'a> {
    pub(super) calls: &'a mut Vec<Call>,
    pub(super) error_name: Option<&'static error_strings::Available>,
}

impl Calls<'_> {
    /// Records a driver call's result; whether it succeeded.
    pub(super) fn cu(&mut self, call: &str, r: sys::CUresult, detail: impl Into<String>) -> bool {
        // cudarc's `CUresult` is a fieldless `repr(u32)` enum; its value is the raw code.
        let code = r as u32 as c_int;
        self.raw(call, code, detail)
    }

    /// Records a driver call's raw result code; whether it is `CUDA_SUCCESS`.
    pub(super) fn raw(&mut self, call: &str, code: c_int, detail: impl Into<String>) -> bool {
        let ok = code == 0;
        self.calls.push(Call {
            call: call.into(),
            code: Some(code.into()),
            name: name_of(self.error_name, code),
            ok,
            detail: detail.into(),
        });
        ok
    }

    /// Records a system call's result; whether it succeeded.
    pub(super) fn sys<T>(
        &mut self,
        call: &str,
        r: &rustix::io::Result<T>,
        detail: impl Into<String>,
    ) -> bool {
        let (code, name) = match r {
            Ok(_) => (0, "OK".to_string()),
            Err(e) => (i64::from(e.raw_os_error()), errno_name(*e)),
        };
        let mut detail = detail.into();
        if let Err(e) = r {
            detail = format!("{detail} ({e})");
        }
        self.calls.push(Call {
            call: call.into(),
            code: Some(code),
            name,
            ok: r.is_ok(),
            detail,
        });
        r.is_ok()
    }

    pub(super) fn check(&mut self, what: &str, result: Result<String, String>) -> bool {
        let ok = result.is_ok();
        let detail = match result {
            Ok(d) | Err(d) => d,
        };
        self.calls.push(Call::check(what, ok, detail));
        ok
    }

    pub(super) fn note(
        &mut self,
        what: &str,
        ok: bool,
        name: &str,
        detail: impl Into<String>,
    ) -> bool {
        self.calls.push(Call::note(what, ok, name, detail));
        ok
    }
}

/// The symbolic name of an errno the probe may meet, else its number.
fn errno_name(e: rustix::io::Errno) -> String {
    use rustix::io::Errno;
    let known = [
        (Errno::PERM, "EPERM"),
        (Errno::NOENT, "ENOENT"),
        (Errno::SRCH, "ESRCH"),
        (Errno::BADF, "EBADF"),
        (Errno::ACCESS, "EACCES"),
        (Errno::INVAL, "EINVAL"),
        (Errno::NOSYS, "ENOSYS"),
        (Errno::MFILE, "EMFILE"),
        (Errno::NOMEM, "ENOMEM"),
    ];
    known.iter().find(|(k, _)| *k == e).map_or_else(
        || format!("errno {}", e.raw_os_error()),
        |(_, n)| n.to_string(),
    )
}
