//! What can be checked without a GPU: the probe and every resolver return instead of
//! panicking, name what they tried, and agree with each other; the structures have the
//! sizes of `cuda.h`.

use super::{
    error_strings, init, library, library_file, missing_symbols, process_checkpoint, vmm,
    ResolveError, LIBRARY_FILES,
};

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

/// The loader says which file it loaded, one of the names it tries; without a driver it
/// lists every name tried, in order, each with the loader's error, and the message of
/// [`library`] names the first of them.
#[test]
fn the_loaded_file_or_every_failure_is_reported() {
    match library_file() {
        Ok(file) => {
            assert!(LIBRARY_FILES.contains(&file), "{file}");
            assert!(library().is_ok());
        }
        Err(failures) => {
            let names: Vec<&str> = failures.iter().map(|(name, _)| *name).collect();
            assert_eq!(names, LIBRARY_FILES);
            let (first, e) = &failures[0];
            let message = library().unwrap_err();
            assert!(message.contains(&format!("{first}: {e}")), "{message}");
        }
    }
}

/// A group's entry points on their own: each present exactly when the probe finds it, and
/// without a driver the loader's message; the safe methods of a missing entry point give
/// `None`.
#[test]
fn available_entry_points_are_the_ones_the_probe_finds() {
    fn check(available: Result<Vec<bool>, ResolveError>, names: &[&'static str]) {
        match available {
            Ok(present) => {
                let missing = missing_symbols(names).unwrap();
                let absent: Vec<&str> = names
                    .iter()
                    .zip(&present)
                    .filter(|(_, present)| !**present)
                    .map(|(name, _)| *name)
                    .collect();
                assert_eq!(absent, missing);
            }
            Err(ResolveError::NoLibrary(message)) => {
                assert_eq!(library().err(), Some(message));
            }
            Err(e) => panic!("available() fails only without a library: {e}"),
        }
    }
    check(
        init::available().map(|a| vec![a.init.is_some(), a.driver_get_version.is_some()]),
        &init::NAMES,
    );
    check(
        error_strings::available().map(|a| vec![a.name.is_some(), a.string.is_some()]),
        &error_strings::NAMES,
    );
    check(
        process_checkpoint::available().map(|a| {
            vec![
                a.lock.is_some(),
                a.checkpoint.is_some(),
                a.restore.is_some(),
                a.unlock.is_some(),
                a.state.is_some(),
            ]
        }),
        &process_checkpoint::NAMES,
    );
    let none = init::Available {
        init: None,
        driver_get_version: None,
    };
    assert_eq!((none.init(), none.driver_version()), (None, None));
    let none = error_strings::Available {
        name: None,
        string: None,
    };
    assert_eq!((none.name(0), none.description(0)), (None, None));
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
