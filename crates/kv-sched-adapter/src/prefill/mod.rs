//! P's connector: the scheduler side that exports finished requests, and the worker side,
//! one per TP rank, that keeps each export's lease, binds it to one owner, and frees it
//! exactly once.

mod book;
mod scheduler;
mod worker;

pub use scheduler::{
    LayerProgress, PrefillCommand, PrefillError, PrefillEvent, PrefillReport, PrefillScheduler, MAX_PAIRINGS,
};
pub use worker::{PrefillBook, PrefillWorker};
