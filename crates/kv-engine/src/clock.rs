//! The engine's one clock.

use std::time::Instant;

use kv_core::{Clock, Time};

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
