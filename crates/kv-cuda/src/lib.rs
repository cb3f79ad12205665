//! kv-core's `Memory` port over CUDA, through cudarc.
//!
//! This crate will hold device pools, pinned-host pools, and plain host pools for machines
//! with no GPU, each handing the transport what it needs to register the region. It is filled
//! by the CUDA issue; nothing here works yet, so nothing is exported, and the crate does not
//! yet depend on cudarc.
