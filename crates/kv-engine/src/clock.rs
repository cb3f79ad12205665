//! The engine's clocks: one per process, or the host's, which every process of it shares.

use std::time::Instant;

use kv_core::{Clock, Time};
use rustix::time::{clock_gettime, ClockId};

/// The monotonic clock of one engine process: time since it started. Every rank's worker and
/// the transports read the same one, so that deadlines cross between them unchanged; a peer's
/// clock is another origin, which the handshake's sample relates.
#[derive(Clone, Copy, Debug)]
pub struct ProcessClock(Instant);

impl ProcessClock {
    /// A clock that reads zero now.
    pub fn start() -> Self {
        ProcessClock(Instant::now())
    }
}

impl Clock for ProcessClock {
    fn now(&self) -> Time {
        Time::from_nanos(u64::try_from(self.0.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }
}

/// The host's monotonic clock (`CLOCK_MONOTONIC`), read as is: every process of one host reads
/// the same clock, so an engine whose scheduler runs in one process and whose ranks run in
/// others (vLLM's engine core and its workers) hands deadlines between them unchanged, as
/// [`ProcessClock`] does between threads. Other hosts' clocks are other origins, which the
/// handshake's sample relates. It counts from the host's boot and does not count suspend.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostClock;

impl Clock for HostClock {
    fn now(&self) -> Time {
        let now = clock_gettime(ClockId::Monotonic);
        let secs = u64::try_from(now.tv_sec).unwrap_or(0);
        let nanos = u64::try_from(now.tv_nsec).unwrap_or(0);
        Time::from_nanos(secs.saturating_mul(1_000_000_000).saturating_add(nanos))
    }
}
