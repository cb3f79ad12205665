//! Time as a value: kvflow's cores never read a clock, they are handed [`Time`].

use std::fmt;
use std::ops::{Add, Sub};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A point on one engine's monotonic clock, in nanoseconds since that clock's origin.
///
/// Two engines' clocks have different origins; a deadline crosses between them through the
/// offset measured at handshake, never by comparing raw values.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
pub struct Time(u64);

impl Time {
    /// The clock's origin.
    pub const ZERO: Time = Time(0);

    /// A time `nanos` after the origin.
    pub const fn from_nanos(nanos: u64) -> Self {
        Time(nanos)
    }

    /// A time `millis` after the origin.
    pub const fn from_millis(millis: u64) -> Self {
        Time(millis.saturating_mul(1_000_000))
    }

    /// A time `secs` after the origin, rounded to the nanosecond.
    pub fn from_secs_f64(secs: f64) -> Self {
        Time((secs.max(0.0) * 1e9).round() as u64)
    }

    /// Nanoseconds since the origin.
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// Seconds since the origin.
    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 / 1e9
    }

    /// `self + d`, saturating at the end of time.
    pub fn saturating_add(self, d: Duration) -> Time {
        Time(self.0.saturating_add(duration_nanos(d)))
    }

    /// `self - d`, saturating at the origin.
    pub fn saturating_sub(self, d: Duration) -> Time {
        Time(self.0.saturating_sub(duration_nanos(d)))
    }

    /// The time from `earlier` to `self`, or zero when `earlier` is later.
    pub fn saturating_since(self, earlier: Time) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }

    /// This time on a clock that reads `offset_nanos` more than this one, saturating at both ends.
    pub fn shifted(self, offset_nanos: i64) -> Time {
        Time(self.0.saturating_add_signed(offset_nanos))
    }
}

fn duration_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Add<Duration> for Time {
    type Output = Time;
    fn add(self, d: Duration) -> Time {
        self.saturating_add(d)
    }
}

impl Sub<Duration> for Time {
    type Output = Time;
    fn sub(self, d: Duration) -> Time {
        self.saturating_sub(d)
    }
}

impl fmt::Debug for Time {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{:09}s", self.0 / 1_000_000_000, self.0 % 1_000_000_000)
    }
}

impl fmt::Display for Time {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_saturates_instead_of_wrapping() {
        assert_eq!(Time::ZERO - Duration::from_secs(1), Time::ZERO);
        assert_eq!(Time::from_nanos(u64::MAX) + Duration::from_secs(1), Time::from_nanos(u64::MAX));
        assert_eq!(Time::from_millis(5).shifted(-10_000_000), Time::ZERO);
        assert_eq!(Time::from_millis(5).shifted(1_000_000), Time::from_millis(6));
        assert_eq!(Time::from_millis(1).saturating_since(Time::from_millis(3)), Duration::ZERO);
        assert_eq!(Time::from_secs_f64(1.5), Time::from_millis(1500));
        assert_eq!(format!("{:?}", Time::from_millis(1500)), "1.500000000s");
    }
}
