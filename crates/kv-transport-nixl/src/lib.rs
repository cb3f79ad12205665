//! kv-core's `Transport` port over NIXL/UCX, through nixl-sys.
//!
//! This crate will hold `NixlTransport` (one agent per TP rank, the UCX backend, descriptor
//! lists prepared once per peer) and the TCP side channel that runs kv-core's handshake. It is
//! filled by the NIXL issue; nothing here works yet, so nothing is exported, and the crate does
//! not yet depend on nixl-sys.
