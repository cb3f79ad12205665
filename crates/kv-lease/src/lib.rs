//! Lease bookkeeping for exported KV blocks, sans-IO.
//!
//! This crate will hold P's lease table (grant, renew as `max(old, now + extension)`, release,
//! expiry at or after the deadline, a poll that costs O(expired + log n)), D's heartbeat
//! planning, acknowledged renewals and the clock-offset arithmetic that carries deadlines
//! between engines. It is filled by the lifecycle issue; nothing here works yet, so nothing is
//! exported.
