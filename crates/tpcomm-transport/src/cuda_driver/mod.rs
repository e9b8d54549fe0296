//! The CUDA driver (`libcuda`) as tpcomm reaches it without linking it (feature
//! `cuda-driver`): the one loader ([`library`]) and its probe ([`missing_symbols`]), shared
//! by the NCCL transport and the CUDA backends of the layers above.

mod library;

pub use library::{library, missing_symbols};

#[cfg(test)]
mod tests;
