//! Holding the addresses of closed peer mappings over a resume, so that the reopened
//! mappings must land elsewhere (shared by the host and capture tests).

use tpcomm_allreduce::backend::Backend;
use tpcomm_allreduce::{AllReduceError, CustomAllReduce, Result};
use tpcomm_ipc::{AddressHold, IpcError};
use tpcomm_transport::Communicator;

/// Suspend / hold / resume rounds a test tries before it gives up on holding every page.
const ATTEMPTS: usize = 5;

/// Suspends `ar` holding the pages of the addresses `old` reads just before the suspend,
/// and returns the holds; the caller resumes. When a page was taken before it could be
/// held ([`hold_pages`]), resumes and tries again, at most [`ATTEMPTS`] times.
pub(crate) fn suspend_holding<B: Backend, C: Communicator>(
    comm: &C,
    ar: &mut CustomAllReduce<B>,
    mut old: impl FnMut(&CustomAllReduce<B>) -> Result<Vec<u64>>,
) -> Result<Vec<AddressHold>> {
    for attempt in 1..=ATTEMPTS {
        let addresses = old(ar)?;
        ar.prepare_for_suspend(comm)?;
        if let Some(holds) = hold_pages(comm, &addresses)? {
            return Ok(holds);
        }
        if attempt < ATTEMPTS {
            ar.reinit_after_resume(comm)?;
        }
    }
    panic!("old addresses taken in each of {ATTEMPTS} attempts");
}

/// Reserves the page of each of `addresses` (just unmapped by a suspend) on this rank, and
/// agrees with every rank whether all of them hold all of their pages. The agreement is
/// also the barrier the test needs: the ranks are threads of one process, and no rank may
/// reopen (map) before every rank holds its pages, or a peer's new mapping could take one.
///
/// `None`, with nothing held, when a page of some rank was already mapped again: other
/// tests of the binary run in threads beside this one, and an allocation of theirs can take
/// a page a suspend has just freed. Any other failure to hold is an error on every rank.
fn hold_pages<C: Communicator>(comm: &C, addresses: &[u64]) -> Result<Option<Vec<AddressHold>>> {
    const HELD: u8 = 0;
    const TAKEN: u8 = 1;
    const FAILED: u8 = 2;
    let held: std::result::Result<Vec<AddressHold>, IpcError> = addresses
        .iter()
        .map(|&a| AddressHold::at(a & !4095, 4096))
        .collect();
    let state = match &held {
        Ok(_) => HELD,
        Err(IpcError::Os { source, .. })
            if std::io::Error::from_raw_os_error(source.raw_os_error()).kind()
                == std::io::ErrorKind::AlreadyExists =>
        {
            TAKEN
        }
        Err(_) => FAILED,
    };
    let mut states = vec![0u8; comm.size()];
    comm.all_gather(&[state], &mut states)?;
    match held {
        Err(e) if state == FAILED => Err(e.into()),
        _ if states.contains(&FAILED) => Err(AllReduceError::InvalidArgument(format!(
            "a peer could not hold its old addresses (states by rank: {states:?})"
        ))),
        Ok(holds) if !states.contains(&TAKEN) => Ok(Some(holds)),
        _ => Ok(None),
    }
}
