//! The connector an engine calls: P and D, scheduler side and worker side, pull and push.
//!
//! This crate will hold the sans-IO state machines that keep DESIGN.md's lifecycle rules
//! (exactly-once release with a reason, staged early completions, sibling release, rejection,
//! abort, peer loss, the read fence, push registration and its watchdog) and a thin driver
//! that runs them over kv-core's `Transport` port. It is filled by the lifecycle issue;
//! nothing here works yet, so nothing is exported.
