//! One module per subcommand: its options, its cases, variants, peer, columns and targets
//! declared for the engine ([`crate::engine`]), and what it runs. A subcommand imports the
//! engine, the data ([`crate::data`]) and the peers ([`crate::peers`]), never another
//! subcommand.

pub(crate) mod allreduce;
pub(crate) mod checkpoint;
pub(crate) mod compare;
pub(crate) mod gpu;
pub(crate) mod ipc;
pub(crate) mod lifecycle;
pub(crate) mod objects;
pub(crate) mod peer_check;
pub(crate) mod plot;
pub(crate) mod queue;
pub(crate) mod transport;
pub(crate) mod tune;
