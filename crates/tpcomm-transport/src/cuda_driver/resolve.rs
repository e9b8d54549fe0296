//! Resolving a group of entry points: the library loaded, every name of the group present,
//! then each read with its C signature; [`ResolveError`] says which step failed. The macro
//! [`entry_points!`] declares a group (names, table, resolver) with each name written once.

#[cfg(feature = "cuda-driver")]
use super::library::{library, missing_symbols};

/// Why a group of driver entry points cannot be used. Returned by every resolver of this
/// module (`vmm::entries`, `process_checkpoint::entries`, ...), and cached with the table:
/// a later call returns the same error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    /// No driver library could be loaded. The message is [`library`]'s: it names every
    /// file name tried and the first failure.
    #[error("{0}")]
    NoLibrary(String),
    /// The library lacks entry points of the group (the driver is older than the group
    /// needs). Displayed as `"{group} (the driver lacks {missing:?}: it is older than
    /// {since})"`.
    #[error("{group} (the driver lacks {missing:?}: it is older than {since})")]
    Missing {
        /// What the group is for, e.g. `"virtual memory management"`.
        group: &'static str,
        /// The entry points the library lacks, in the order of the group's `NAMES`.
        missing: Vec<&'static str>,
        /// The first CUDA version whose driver has every entry point of the group, e.g.
        /// `"CUDA 11.4"`.
        since: &'static str,
    },
    /// An entry point the library exports could not be read (the loader's message).
    #[error("{name}: {message}")]
    Symbol {
        /// The entry point.
        name: &'static str,
        /// What the loader said.
        message: String,
    },
}

/// What a group is, for [`ResolveError::Missing`]: its purpose, its entry points and the
/// first CUDA version that has them all.
#[cfg(feature = "cuda-driver")]
#[derive(Debug, Clone, Copy)]
pub(super) struct Group {
    pub(super) purpose: &'static str,
    pub(super) names: &'static [&'static str],
    pub(super) since: &'static str,
}

#[cfg(feature = "cuda-driver")]
impl Group {
    /// Loads the library, checks that it exports every name of the group, then builds the
    /// table with `read` (which reads each entry point with [`symbol`]). Calls no driver
    /// function.
    pub(super) fn resolve<T>(
        self,
        read: impl FnOnce(&'static libloading::Library) -> Result<T, ResolveError>,
    ) -> Result<T, ResolveError> {
        let lib = library().map_err(ResolveError::NoLibrary)?;
        let missing = missing_symbols(self.names).map_err(ResolveError::NoLibrary)?;
        if !missing.is_empty() {
            return Err(ResolveError::Missing {
                group: self.purpose,
                missing,
                since: self.since,
            });
        }
        read(lib)
    }
}

/// The entry point `name` of `lib`, read as `T`.
///
/// # Safety
/// `T` is the function pointer type of `name`'s C signature in `cuda.h`; the library stays
/// loaded for the process (as [`library`] keeps it), so the pointer stays valid.
#[cfg(feature = "cuda-driver")]
pub(super) unsafe fn symbol<T: Copy>(
    lib: &'static libloading::Library,
    name: &'static str,
) -> Result<T, ResolveError> {
    // SAFETY: the caller's contract: `T` is the C signature of `name`.
    unsafe { lib.get::<T>(name.as_bytes()) }
        .map(|symbol| *symbol)
        .map_err(|e| ResolveError::Symbol {
            name,
            message: e.to_string(),
        })
}

/// Declares a group of entry points in the module it is invoked in: `NAMES` (every entry
/// point's name, in the table's order), the table `Entries` (one field per entry point,
/// typed with its C signature) and `entries()`, which resolves the table once per process
/// (every entry point or an error), and `Available` with `available()`, the same table with
/// each entry point on its own (`None` where the library lacks it). Each entry point is
/// named once, next to its field and type.
macro_rules! entry_points {
    (
        purpose: $purpose:literal,
        since: $since:literal,
        $($field:ident: $ty:ty = $name:literal,)+
    ) => {
        /// Every entry point of [`Entries`], by name, in the order of its fields (the order
        /// in which [`ResolveError::Missing`](crate::cuda_driver::ResolveError::Missing)
        /// lists the ones a driver lacks).
        pub const NAMES: [&str; [$($name),+].len()] = [$($name),+];

        /// The entry points of this group, resolved once per process by [`entries`]. Calling
        /// one is `unsafe`: the caller keeps the C function's contract.
        #[derive(Debug, Clone, Copy)]
        pub struct Entries {
            $(
                #[doc = concat!("`", $name, "`.")]
                pub $field: $ty,
            )+
        }

        #[doc = concat!(
            "The entry points of ", $purpose, ", resolved once per process (the result, an ",
            "error too, is cached): [`ResolveError::NoLibrary`]",
            "(crate::cuda_driver::ResolveError::NoLibrary) without a driver library, ",
            "[`ResolveError::Missing`](crate::cuda_driver::ResolveError::Missing) naming ",
            "the entry points a driver older than ", $since, " lacks. Calls no driver ",
            "function, never panics."
        )]
        #[cfg(feature = "cuda-driver")]
        pub fn entries(
        ) -> Result<&'static Entries, $crate::cuda_driver::ResolveError> {
            use $crate::cuda_driver::resolve::{symbol, Group};
            static ENTRIES: std::sync::OnceLock<
                Result<Entries, $crate::cuda_driver::ResolveError>,
            > = std::sync::OnceLock::new();
            const GROUP: Group = Group {
                purpose: $purpose,
                names: &NAMES,
                since: $since,
            };
            ENTRIES
                .get_or_init(|| {
                    GROUP.resolve(|lib| {
                        // SAFETY: each entry point is read with the type of its field, its C
                        // signature in cuda.h; the library stays loaded for the process, so
                        // the pointers stay valid.
                        unsafe { Ok(Entries { $($field: symbol(lib, $name)?,)+ }) }
                    })
                })
                .as_ref()
                .map_err(Clone::clone)
        }

        /// Each entry point of [`Entries`] that the library exports, `None` for one it lacks,
        /// resolved once per process by [`available`]: for a layer that uses the ones it
        /// finds and decides itself what a missing one means.
        #[derive(Debug, Clone, Copy)]
        pub struct Available {
            $(
                #[doc = concat!("`", $name, "`, when the library exports it.")]
                pub $field: Option<$ty>,
            )+
        }

        #[doc = concat!(
            "The entry points of ", $purpose, " that the library exports, each on its own ",
            "(an entry point it lacks, or cannot read, is `None`), resolved once per process; ",
            "[`ResolveError::NoLibrary`](crate::cuda_driver::ResolveError::NoLibrary) without ",
            "a driver library. Calls no driver function, never panics."
        )]
        #[cfg(feature = "cuda-driver")]
        pub fn available(
        ) -> Result<&'static Available, $crate::cuda_driver::ResolveError> {
            use $crate::cuda_driver::resolve::symbol;
            static AVAILABLE: std::sync::OnceLock<
                Result<Available, $crate::cuda_driver::ResolveError>,
            > = std::sync::OnceLock::new();
            AVAILABLE
                .get_or_init(|| {
                    let lib = $crate::cuda_driver::library()
                        .map_err($crate::cuda_driver::ResolveError::NoLibrary)?;
                    // SAFETY: each entry point is read with the type of its field, its C
                    // signature in cuda.h; the library stays loaded for the process, so the
                    // pointers stay valid.
                    unsafe { Ok(Available { $($field: symbol(lib, $name).ok(),)+ }) }
                })
                .as_ref()
                .map_err(Clone::clone)
        }
    };
}
pub(super) use entry_points;
