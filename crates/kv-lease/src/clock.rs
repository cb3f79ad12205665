//! Deadlines across two engines' clocks.
//!
//! P's lease deadlines are on P's clock. D measures the offset (P's clock minus D's) at
//! handshake, from the sample with the lowest round trip, and widens its safety margin by
//! half that round trip, the sample's error bound. D starts a read only if it ends, with the
//! margin, before the deadline seen on D's clock.

use std::time::Duration;

use kv_core::Time;

/// The offset between a peer's clock and ours, with its error bound.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct ClockOffset {
    /// Peer clock minus local clock, in nanoseconds.
    pub offset_nanos: i64,
    /// Half the round trip of the sample it was taken from.
    pub uncertainty: Duration,
}

impl ClockOffset {
    /// An offset from one handshake sample.
    pub fn from_sample(offset_nanos: i64, round_trip: Duration) -> Self {
        ClockOffset { offset_nanos, uncertainty: round_trip / 2 }
    }

    /// Keeps the better of two samples (the one with the smaller uncertainty).
    pub fn better(self, other: ClockOffset) -> ClockOffset {
        if other.uncertainty < self.uncertainty {
            other
        } else {
            self
        }
    }

    /// A peer-clock time on the local clock.
    pub fn to_local(&self, peer_time: Time) -> Time {
        peer_time.shifted(self.offset_nanos.saturating_neg())
    }

    /// A local time on the peer's clock.
    pub fn to_peer(&self, local_time: Time) -> Time {
        local_time.shifted(self.offset_nanos)
    }

    /// The latest local time a read may start and still end, by `read_time` plus `margin`
    /// plus this offset's uncertainty, before the peer's `deadline`.
    pub fn last_safe_start(&self, deadline: Time, margin: Duration, read_time: Duration) -> Time {
        self.to_local(deadline).saturating_sub(margin + self.uncertainty + read_time)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadlines_move_between_clocks() {
        // P's clock reads 100 s more than D's; the sample's round trip was 2 ms.
        let off = ClockOffset::from_sample(100_000_000_000, Duration::from_millis(2));
        assert_eq!(off.to_local(Time::from_millis(130_000)), Time::from_millis(30_000));
        assert_eq!(off.to_peer(Time::from_millis(30_000)), Time::from_millis(130_000));
        // A 30 s deadline on P, 5 s margin, 1 ms uncertainty, 10 ms read: start by 24.989 s.
        let last = off.last_safe_start(Time::from_millis(130_000), Duration::from_secs(5), Duration::from_millis(10));
        assert_eq!(last, Time::from_millis(24_989));
        let worse = ClockOffset::from_sample(0, Duration::from_millis(50));
        assert_eq!(off.better(worse), off);
        assert_eq!(worse.better(off), off);
        // A deadline already past saturates at the origin instead of wrapping.
        assert_eq!(
            ClockOffset::default().last_safe_start(Time::from_millis(1), Duration::from_secs(5), Duration::ZERO),
            Time::ZERO
        );
    }
}
