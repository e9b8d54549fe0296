//! The benchmark engine every subcommand runs on, like criterion's or nccl-tests' common
//! code: a subcommand declares its cases, variants, peer, columns and targets; the engine
//! starts the ranks, verifies, times, prints, judges and writes the report.
//!
//! - [`launch`]: the ranks (threads of a local group, or MPI ranks) and [`launch::Bench`],
//!   what a measuring subcommand declares;
//! - [`session`]: one rank's run: verification, timing, printing, the report at the end;
//! - [`timing`]: the interleaved timing loop and the declared case ([`timing::Spec`]);
//! - [`lineup`]: ranks lined up by a spinning all-reduce before a timed iteration;
//! - [`verify`]: wrong data agreed across ranks;
//! - [`row`]: the one row type of every table and of the JSON report;
//! - [`targets`]: targets, their judges and verdicts; [`summary`]: helpers of closing lines;
//! - [`table`]: the printed tables and progress; [`report`]: the JSON report;
//! - [`placement`]: where the ranks ran while a case was timed;
//! - [`sweep`]: the size sweep and the iteration policy; [`options`]: option values several
//!   subcommands share; [`error`]: the one error type.

pub(crate) mod error;
pub(crate) mod launch;
pub(crate) mod lineup;
pub(crate) mod options;
pub(crate) mod placement;
pub(crate) mod report;
pub(crate) mod row;
pub(crate) mod session;
pub(crate) mod summary;
pub(crate) mod sweep;
pub(crate) mod table;
pub(crate) mod targets;
pub(crate) mod timing;
pub(crate) mod verify;
