//! Contract checks for port adapters: what every [`Memory`] and every
//! [`Transport`](crate::Transport) must do, whatever it runs on.
//!
//! An adapter's tests call these on an instance of their own (behind the `contract` feature,
//! as a dev-dependency), so an adapter author learns that the adapter keeps the port's
//! contract without knowing any other adapter. A broken rule panics with a message that names
//! it, as a failed `assert!` does.
//!
//! ```
//! // In an adapter's tests, with its own `Memory` in place of the reference one:
//! kv_core::contract::memory(&mut kv_core::contract::VecMemory::default());
//! ```
//!
//! A transport adapter implements [`TransportPair`] for two of its agents, connected to each
//! other, and calls [`transport`] with a function that makes such a pair (a check that ends
//! its pair gets a fresh one): notifications only after the bytes are in place, outcomes
//! reported once, unregistered ranges refused, prepared transfers equal to address pairs, a
//! killed peer reported lost, and a peer disconnected by the other side reported lost after
//! what it said before, on both sides.

use std::collections::HashMap;

mod transport;

pub use transport::*;

use crate::ports::{Memory, MemoryError, MemoryKind, Region, RegionId};

/// Runs every [`Memory`] rule on `memory`, with host regions (every adapter provides them).
pub fn memory(memory: &mut dyn Memory) {
    memory_bytes_round_trip_within_bounds_only(memory);
    memory_free_forgets_a_region(memory);
}

/// A fresh region reads as zeros; written bytes read back where they were written; a range
/// past the region's end, or in a region that is not there, is refused with an error that
/// names it and changes nothing.
pub fn memory_bytes_round_trip_within_bounds_only(memory: &mut dyn Memory) {
    let region = memory.allocate(MemoryKind::Host, 16).expect("16 bytes of host memory");
    assert_eq!((region.kind, region.len), (MemoryKind::Host, 16), "the region is what was asked for: {region:?}");
    let mut out = [0xff; 16];
    memory.read(region.id, 0, &mut out).expect("reading a whole fresh region");
    assert_eq!(out, [0; 16], "a fresh region reads as zeros");
    memory.write(region.id, 4, b"kvkv").expect("writing inside the region");
    let mut out = [0; 6];
    memory.read(region.id, 3, &mut out).expect("reading inside the region");
    assert_eq!(&out, b"\0kvkv\0", "bytes read back where they were written");
    let out_of_bounds = |offset, len| MemoryError::OutOfBounds { region: region.id, offset, len, region_len: 16 };
    assert_eq!(memory.write(region.id, 14, b"abc"), Err(out_of_bounds(14, 3)), "a write past the end");
    assert_eq!(memory.read(region.id, u64::MAX, &mut [0; 2]), Err(out_of_bounds(u64::MAX, 2)), "offset overflow");
    memory.read(region.id, 3, &mut out).expect("reading inside the region");
    assert_eq!(&out, b"\0kvkv\0", "a refused write changed nothing");
    let missing = RegionId(u64::MAX);
    assert_eq!(memory.read(missing, 0, &mut []), Err(MemoryError::UnknownRegion(missing)), "an unknown region");
    memory.free(region.id).expect("freeing the region");
}

/// A freed region is gone: freeing it again, or writing or reading it, is refused, and the
/// other regions keep their bytes.
pub fn memory_free_forgets_a_region(memory: &mut dyn Memory) {
    let a = memory.allocate(MemoryKind::Host, 8).expect("8 bytes of host memory");
    let b = memory.allocate(MemoryKind::Host, 8).expect("8 more bytes of host memory");
    assert_ne!(a.id, b.id, "two live regions have two ids");
    memory.write(b.id, 0, b"survives").expect("writing the second region");
    memory.free(a.id).expect("freeing the first region");
    let gone = Err(MemoryError::UnknownRegion(a.id));
    assert_eq!(memory.free(a.id), gone, "a second free");
    assert_eq!(memory.write(a.id, 0, b"x"), gone, "a write after free");
    assert_eq!(memory.read(a.id, 0, &mut [0; 1]), gone, "a read after free");
    let mut out = [0; 8];
    memory.read(b.id, 0, &mut out).expect("reading the second region");
    assert_eq!(&out, b"survives", "freeing one region leaves the other's bytes");
    memory.free(b.id).expect("freeing the second region");
}

/// The smallest [`Memory`] that keeps the contract: host bytes in plain vectors, whatever kind
/// is asked for; a reference for adapter authors, and what the contract itself is tested on.
#[derive(Default, Debug)]
pub struct VecMemory {
    regions: HashMap<RegionId, Vec<u8>>,
    next: u64,
}

impl VecMemory {
    fn bytes(&self, region: RegionId, offset: u64, len: usize) -> Result<std::ops::Range<usize>, MemoryError> {
        let bytes = self.regions.get(&region).ok_or(MemoryError::UnknownRegion(region))?;
        let region_len = bytes.len() as u64;
        let out = MemoryError::OutOfBounds { region, offset, len: len as u64, region_len };
        let end = offset.checked_add(len as u64).filter(|&end| end <= region_len).ok_or(out)?;
        Ok(offset as usize..end as usize)
    }
}

impl Memory for VecMemory {
    fn allocate(&mut self, kind: MemoryKind, len: u64) -> Result<Region, MemoryError> {
        let size =
            usize::try_from(len).map_err(|_| MemoryError::Allocation { kind, len, reason: "too large".into() })?;
        self.next += 1;
        let id = RegionId(self.next);
        self.regions.insert(id, vec![0; size]);
        Ok(Region { id, kind, addr: self.next << 32, len })
    }

    fn free(&mut self, region: RegionId) -> Result<(), MemoryError> {
        self.regions.remove(&region).map(drop).ok_or(MemoryError::UnknownRegion(region))
    }

    fn read(&self, region: RegionId, offset: u64, out: &mut [u8]) -> Result<(), MemoryError> {
        let range = self.bytes(region, offset, out.len())?;
        out.copy_from_slice(&self.regions[&region][range]);
        Ok(())
    }

    fn write(&mut self, region: RegionId, offset: u64, data: &[u8]) -> Result<(), MemoryError> {
        let range = self.bytes(region, offset, data.len())?;
        self.regions.get_mut(&region).expect("checked")[range].copy_from_slice(data);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reference_memory_keeps_the_contract() {
        memory(&mut VecMemory::default());
    }
}
