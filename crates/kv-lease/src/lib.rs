//! Lease bookkeeping for exported KV blocks, sans-IO.
//!
//! kv-lease reads no clock and does no I/O: every method that needs the time takes `now`
//! as a [`kv_core::Time`]. It holds P's [`LeaseTable`] (grant; renew as
//! `max(old, now + extension)`; release; expiry at or after the deadline; a poll of what
//! expired that reads only what is due rather than scanning every lease; grant, renew and
//! release cost the same at any number of leases) and
//! [`ScanLeaseTable`], the full-scan baseline that benchmarks and property tests compare it
//! with. For D it holds the [`HeartbeatPlanner`] (per peer, at the interval), with
//! [`renewal_slack`], the least a renewed lease has left at any point of the heartbeat cycle
//! (what bounds D's read margin), and [`ClockOffset`], which carries P's deadlines onto D's
//! clock for the read fence.
//!
//! ```
//! use std::time::Duration;
//! use kv_core::Time;
//! use kv_lease::LeaseTable;
//!
//! let mut leases = LeaseTable::new();
//! leases.grant("r1", Time::from_millis(30_000))?;
//! // D's heartbeat at 20 s extends the lease to 40 s.
//! assert_eq!(leases.renew(&"r1", Time::from_millis(20_000), Duration::from_secs(20)), Some(Time::from_millis(40_000)));
//! // The drive loop polls at its wake-up; nothing is due before 40 s.
//! assert_eq!(leases.poll_expired(Time::from_millis(39_999)), None);
//! assert_eq!(leases.poll_expired(Time::from_millis(40_000)), Some(("r1", Time::from_millis(40_000))));
//! # Ok::<(), kv_lease::LeaseError>(())
//! ```

mod clock;
mod heartbeat;
mod table;

pub use clock::ClockOffset;
pub use heartbeat::{renewal_slack, HeartbeatPlanner};
pub use table::{LeaseError, LeaseTable, ScanLeaseTable};
