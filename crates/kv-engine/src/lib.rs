//! One engine's side of kvflow's connector, as an engine embeds it.
//!
//! kv-sched-adapter's connectors are sans-IO: a scheduler, and a worker per TP rank that a
//! [`WorkerDriver`](kv_sched_adapter::driver::WorkerDriver) runs over any
//! [`Transport`](kv_core::Transport). This crate is the glue every engine around them needs,
//! written once (the demo's `kvflow-node` runs on it):
//!
//! - [`Engine`]: an engine's scheduler ([`kv_sched_adapter::PrefillScheduler`] or
//!   [`kv_sched_adapter::DecodeScheduler`]) on the engine's thread and a [`RankThread`] per TP
//!   rank; [`Engine::poll`] carries the scheduler's commands to the ranks and their reports
//!   back, and returns what the engine itself must do (free blocks, use a load).
//! - [`RankThread`]: a thread per TP rank, as an engine runs one worker per GPU, stepping its
//!   driver at its own wake-ups and carrying out the scheduler's commands at once
//!   ([`WorkerDriver::command`](kv_sched_adapter::driver::WorkerDriver::command)); its reports
//!   come back on a channel that unparks the engine's thread.
//! - [`Registration`]: the engine published in a [`Discovery`](kv_core::discovery::Discovery)
//!   registry on a thread of its own, and the engine incarnations it finds lost ([`Found`]),
//!   which the engine hands every rank.
//! - [`metrics`]: the process's recorder of the connectors' metrics, and
//!   [`MetricsEndpoint`](metrics::MetricsEndpoint), which serves them to Prometheus with a bound
//!   on the connections a peer can hold.
//! - [`ProcessClock`]: the one clock of the engine's process; [`HostClock`], the one clock of
//!   every process of the host, for an engine whose ranks run in processes of their own.
//!
//! It names no adapter: the binary picks the transport (NIXL, TCP) and the registry (etcd,
//! static) and hands them in.

mod clock;
mod discovery;
mod engine;
pub mod metrics;
mod rank;

pub use clock::{HostClock, ProcessClock};
pub use discovery::{Found, Registration, RegistrationError};
pub use engine::{Engine, EngineError, Next, Scheduler};
pub use rank::{CommandObserver, RankOptions, RankStatus, RankThread, IDLE_WAIT};
