//! What can be checked without a GPU: the probe and every resolver return instead of
//! panicking, name what they tried, and agree with each other; the structures have the
//! sizes of `cuda.h`.

use super::{error_strings, init, library, missing_symbols, process_checkpoint, vmm, ResolveError};

/// Without a driver, the probe fails with the names it tried; with one, a made-up symbol
/// is reported missing and a real one is not. Either way it returns instead of panicking.
#[test]
fn probe_reports_instead_of_panicking() {
    match missing_symbols(&["cuInit", "tpcommNoSuchSymbol"]) {
        Ok(missing) => assert_eq!(missing, ["tpcommNoSuchSymbol"]),
        Err(message) => {
            assert!(message.contains("libcuda.so.1"), "{message}");
            // Asked again, the cached failure comes back the same.
            assert_eq!(missing_symbols(&["cuInit"]), Err(message));
        }
    }
}

/// Without a driver every resolver reports the loader's message (the file names tried);
/// with one, each either resolves or lists what the driver lacks, in `NAMES` order, and
/// its `Display` says so with the group's purpose. Nothing panics.
#[test]
fn every_group_resolves_or_names_what_is_missing() {
    fn check<T>(resolved: Result<&'static T, ResolveError>, names: &[&'static str], purpose: &str) {
        match resolved {
            Ok(_) => {}
            Err(ResolveError::NoLibrary(message)) => {
                assert!(message.contains("libcuda.so.1"), "{message}");
                assert_eq!(library().err(), Some(message));
            }
            Err(e @ ResolveError::Missing { .. }) => {
                let ResolveError::Missing { group, missing, .. } = &e else {
                    unreachable!()
                };
                assert_eq!(*group, purpose);
                assert!(!missing.is_empty());
                assert_eq!(missing_symbols(names).as_deref(), Ok(missing.as_slice()));
                assert!(e.to_string().starts_with(purpose), "{e}");
            }
            Err(e @ ResolveError::Symbol { .. }) => panic!("a probed symbol was unreadable: {e}"),
        }
    }
    check(vmm::entries(), &vmm::NAMES, "virtual memory management");
    check(
        process_checkpoint::entries(),
        &process_checkpoint::NAMES,
        "process checkpoint",
    );
    check(init::entries(), &init::NAMES, "driver initialization");
    check(
        error_strings::entries(),
        &error_strings::NAMES,
        "error strings",
    );
    // Asked again, the cached result comes back the same.
    assert_eq!(
        vmm::entries().map(|e| e.create as usize),
        vmm::entries().map(|e| e.create as usize)
    );
}

/// A group's missing entry points are displayed with the group's purpose and the CUDA
/// version that has them, as the layers that adopt the resolvers report them.
#[test]
fn a_missing_group_is_displayed_with_its_purpose_and_version() {
    let e = ResolveError::Missing {
        group: "virtual memory management",
        missing: vec!["cuMemCreate", "cuMemMap"],
        since: "CUDA 11.4",
    };
    assert_eq!(
        e.to_string(),
        "virtual memory management (the driver lacks [\"cuMemCreate\", \"cuMemMap\"]: it is \
         older than CUDA 11.4)"
    );
    let e = ResolveError::Symbol {
        name: "cuMemMap",
        message: "undefined symbol".into(),
    };
    assert_eq!(e.to_string(), "cuMemMap: undefined symbol");
}

/// The argument structures have the sizes `cuda.h` gives them (also asserted at compile
/// time), and the names lists match the tables' fields one to one.
#[test]
fn structures_and_name_lists_have_the_sizes_of_cuda_h() {
    use std::mem::size_of;
    assert_eq!(size_of::<vmm::Location>(), 8);
    assert_eq!(size_of::<vmm::AllocationProp>(), 32);
    assert_eq!(size_of::<vmm::AccessDesc>(), 12);
    assert_eq!(size_of::<process_checkpoint::LockArgs>(), 64);
    assert_eq!(size_of::<process_checkpoint::ReservedArgs>(), 64);
    let fn_ptr = size_of::<usize>();
    assert_eq!(size_of::<vmm::Entries>(), vmm::NAMES.len() * fn_ptr);
    assert_eq!(
        size_of::<process_checkpoint::Entries>(),
        process_checkpoint::NAMES.len() * fn_ptr
    );
    assert_eq!(size_of::<init::Entries>(), init::NAMES.len() * fn_ptr);
    assert_eq!(
        size_of::<error_strings::Entries>(),
        error_strings::NAMES.len() * fn_ptr
    );
    let lock = process_checkpoint::LockArgs::new(250);
    assert_eq!(
        (lock.timeout_ms, lock.reserved0, lock.reserved1),
        (250, 0, [0; 7])
    );
}
