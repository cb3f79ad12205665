//! A clock that moves only when a test or the simulator moves it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kv_core::{Clock, Time};

/// A shared, manually driven [`Clock`]: clones read and move the same time.
///
/// Time never goes backwards: [`ManualClock::advance_to`] an earlier time is a no-op, so a
/// simulator can jump to "the next event" without first checking that it is in the future.
#[derive(Clone, Default, Debug)]
pub struct ManualClock {
    nanos: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock that reads `start`.
    pub fn new(start: Time) -> Self {
        ManualClock { nanos: Arc::new(AtomicU64::new(start.as_nanos())) }
    }

    /// The current time.
    pub fn now(&self) -> Time {
        Time::from_nanos(self.nanos.load(Ordering::SeqCst))
    }

    /// Moves the clock `by` forward, saturating at the end of time; returns the new time.
    pub fn advance(&self, by: Duration) -> Time {
        let by = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        let before = self.nanos.fetch_add_saturating(by);
        Time::from_nanos(before.saturating_add(by))
    }

    /// Moves the clock to `t` if `t` is later than now, else leaves it; returns the new time.
    pub fn advance_to(&self, t: Time) -> Time {
        let before = self.nanos.fetch_max(t.as_nanos(), Ordering::SeqCst);
        Time::from_nanos(before.max(t.as_nanos()))
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Time {
        ManualClock::now(self)
    }
}

/// `fetch_add` that stops at `u64::MAX` instead of wrapping back to the origin.
trait FetchAddSaturating {
    fn fetch_add_saturating(&self, by: u64) -> u64;
}

impl FetchAddSaturating for AtomicU64 {
    fn fetch_add_saturating(&self, by: u64) -> u64 {
        let step = |n: u64| Some(n.saturating_add(by));
        // The closure never returns None, so both arms hold the previous value.
        match self.fetch_update(Ordering::SeqCst, Ordering::SeqCst, step) {
            Ok(previous) | Err(previous) => previous,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clones_share_one_time_that_never_goes_backwards() {
        let clock = ManualClock::new(Time::from_millis(5));
        let other = clock.clone();
        assert_eq!(other.advance(Duration::from_millis(3)), Time::from_millis(8));
        assert_eq!(clock.now(), Time::from_millis(8));
        assert_eq!(clock.advance_to(Time::from_millis(2)), Time::from_millis(8));
        assert_eq!(clock.advance_to(Time::from_millis(20)), Time::from_millis(20));
        assert_eq!(Clock::now(&other), Time::from_millis(20));
        assert_eq!(clock.advance(Duration::MAX), Time::from_nanos(u64::MAX));
    }
}
