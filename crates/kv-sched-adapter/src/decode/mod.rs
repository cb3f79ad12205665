//! D's connector: the scheduler side that admits, schedules, rejects and aborts requests
//! carrying P's transfer parameters, and the worker side, one per TP rank, that claims and
//! renews P's leases, loads the KV, and tells P when it is done.

mod scheduler;
mod worker;

pub use scheduler::{DecodeCommand, DecodeError, DecodeEvent, DecodeReport, DecodeScheduler, DecodeState, LoadOutcome};
pub use worker::DecodeWorker;
