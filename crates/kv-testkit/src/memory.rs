//! In-memory KV pools: a shared heap of byte buffers at synthetic addresses, and the
//! [`Memory`] port over it.
//!
//! The fake transport copies bytes by address, as NIXL does, so a pool's regions live in a
//! [`FakeHeap`] that the engine's [`InMemoryMemory`] and its [`crate::FakeTransport`] share.
//! Addresses are handed out page-aligned from a counter with a free page between regions, so
//! that a range running off the end of a region never lands in the next one.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use kv_core::{Memory, MemoryError, MemoryKind, Region, RegionId};

/// A shared handle to byte buffers keyed by synthetic, non-overlapping addresses.
///
/// Give each engine (or each TP rank) its own heap with its own base: two heaps with the same
/// base hand out the same addresses, which would hide a plan that swaps local and remote.
#[derive(Clone, Debug)]
pub struct FakeHeap {
    state: Arc<Mutex<HeapState>>,
}

#[derive(Debug)]
struct HeapState {
    next_addr: u64,
    live_bytes: u64,
    buffers: BTreeMap<u64, Vec<u8>>,
}

impl Default for FakeHeap {
    fn default() -> Self {
        FakeHeap::new()
    }
}

impl FakeHeap {
    /// The first address of a heap made by [`FakeHeap::new`].
    pub const DEFAULT_BASE: u64 = 0x1000_0000;
    /// Alignment of every region, and the gap left after each.
    pub const PAGE: u64 = 4096;
    /// Most bytes a heap holds at once; a larger allocation fails instead of exhausting the host.
    pub const CAPACITY: u64 = 1 << 30;

    /// An empty heap starting at [`FakeHeap::DEFAULT_BASE`].
    pub fn new() -> Self {
        FakeHeap::with_base(FakeHeap::DEFAULT_BASE)
    }

    /// An empty heap whose first region starts at `base`, rounded down to a page.
    pub fn with_base(base: u64) -> Self {
        let state = HeapState { next_addr: base & !(Self::PAGE - 1), live_bytes: 0, buffers: BTreeMap::new() };
        FakeHeap { state: Arc::new(Mutex::new(state)) }
    }

    /// Bytes allocated and not yet freed (a leak check after a run).
    pub fn live_bytes(&self) -> u64 {
        self.lock().live_bytes
    }

    fn lock(&self) -> MutexGuard<'_, HeapState> {
        // A panic while holding the lock leaves whole buffers behind, which are still usable.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn allocate(&self, len: u64) -> Result<u64, String> {
        let mut heap = self.lock();
        if len > Self::CAPACITY - heap.live_bytes {
            return Err(format!("heap capacity of {} bytes exhausted, {} live", Self::CAPACITY, heap.live_bytes));
        }
        let addr = heap.next_addr;
        let next = addr
            .checked_add(len)
            .and_then(|end| end.checked_add(Self::PAGE))
            .and_then(|end| end.checked_next_multiple_of(Self::PAGE))
            .ok_or_else(|| format!("address space exhausted at {addr:#x}"))?;
        // len <= CAPACITY, which fits in usize on every host this runs on.
        heap.buffers.insert(addr, vec![0; len as usize]);
        heap.next_addr = next;
        heap.live_bytes += len;
        Ok(addr)
    }

    fn free(&self, addr: u64) {
        let mut heap = self.lock();
        if let Some(buffer) = heap.buffers.remove(&addr) {
            heap.live_bytes -= buffer.len() as u64;
        }
    }

    /// Whether `addr..addr + len` lies inside one allocated buffer.
    pub(crate) fn contains(&self, addr: u64, len: u64) -> bool {
        self.with_range(addr, len, |_| ()).is_some()
    }

    /// A copy of `len` bytes at `addr`, if they lie inside one allocated buffer.
    pub(crate) fn read_at(&self, addr: u64, len: u64) -> Option<Vec<u8>> {
        self.with_range(addr, len, |bytes| bytes.to_vec())
    }

    /// Copies `data` to `addr`; false (and nothing written) outside the allocated buffers.
    pub(crate) fn write_at(&self, addr: u64, data: &[u8]) -> bool {
        self.with_range(addr, data.len() as u64, |bytes| bytes.copy_from_slice(data)).is_some()
    }

    fn with_range<R>(&self, addr: u64, len: u64, f: impl FnOnce(&mut [u8]) -> R) -> Option<R> {
        let mut heap = self.lock();
        let (&base, buffer) = heap.buffers.range_mut(..=addr).next_back()?;
        let start = usize::try_from(addr - base).ok()?;
        let end = start.checked_add(usize::try_from(len).ok()?)?;
        buffer.get_mut(start..end).map(f)
    }
}

/// One engine rank's KV pool memory over a [`FakeHeap`]: every [`MemoryKind`] is accepted and
/// lives in host memory, zeroed on allocation.
#[derive(Debug)]
pub struct InMemoryMemory {
    heap: FakeHeap,
    regions: BTreeMap<RegionId, Region>,
    next_id: u64,
}

impl InMemoryMemory {
    /// A pool that allocates from `heap`.
    pub fn new(heap: FakeHeap) -> Self {
        InMemoryMemory { heap, regions: BTreeMap::new(), next_id: 1 }
    }

    /// The heap the regions live in (hand it to the rank's [`crate::FakeTransport`]).
    pub fn heap(&self) -> &FakeHeap {
        &self.heap
    }

    /// The regions allocated and not freed, by id.
    pub fn regions(&self) -> impl Iterator<Item = &Region> + '_ {
        self.regions.values()
    }

    /// Frees every region: what an engine crash does to its pool.
    pub fn free_all(&mut self) {
        for region in std::mem::take(&mut self.regions).into_values() {
            self.heap.free(region.addr);
        }
    }

    /// The address of `offset..offset + len` in `region`, checked against the region's bounds.
    fn locate(&self, region: RegionId, offset: u64, len: u64) -> Result<u64, MemoryError> {
        let found = self.regions.get(&region).ok_or(MemoryError::UnknownRegion(region))?;
        match offset.checked_add(len) {
            Some(end) if end <= found.len => Ok(found.addr + offset),
            _ => Err(MemoryError::OutOfBounds { region, offset, len, region_len: found.len }),
        }
    }
}

impl Memory for InMemoryMemory {
    fn allocate(&mut self, kind: MemoryKind, len: u64) -> Result<Region, MemoryError> {
        let addr = self.heap.allocate(len).map_err(|reason| MemoryError::Allocation { kind, len, reason })?;
        let region = Region { id: RegionId(self.next_id), kind, addr, len };
        self.next_id += 1;
        self.regions.insert(region.id, region);
        Ok(region)
    }

    fn free(&mut self, region: RegionId) -> Result<(), MemoryError> {
        let freed = self.regions.remove(&region).ok_or(MemoryError::UnknownRegion(region))?;
        self.heap.free(freed.addr);
        Ok(())
    }

    fn read(&self, region: RegionId, offset: u64, out: &mut [u8]) -> Result<(), MemoryError> {
        let addr = self.locate(region, offset, out.len() as u64)?;
        let bytes = self.heap.read_at(addr, out.len() as u64).ok_or(MemoryError::UnknownRegion(region))?;
        out.copy_from_slice(&bytes);
        Ok(())
    }

    fn write(&mut self, region: RegionId, offset: u64, data: &[u8]) -> Result<(), MemoryError> {
        let addr = self.locate(region, offset, data.len() as u64)?;
        if self.heap.write_at(addr, data) {
            Ok(())
        } else {
            Err(MemoryError::UnknownRegion(region))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_are_zeroed_aligned_and_apart() {
        let mut memory = InMemoryMemory::new(FakeHeap::new());
        let a = memory.allocate(MemoryKind::Device(3), 10).unwrap();
        let b = memory.allocate(MemoryKind::PinnedHost, FakeHeap::PAGE).unwrap();
        let c = memory.allocate(MemoryKind::Host, 0).unwrap();
        assert_eq!(a.addr, FakeHeap::DEFAULT_BASE);
        assert_eq!((a.kind, a.len), (MemoryKind::Device(3), 10));
        for (earlier, later) in [(a, b), (b, c)] {
            assert_eq!(later.addr % FakeHeap::PAGE, 0);
            assert!(later.addr >= earlier.addr + earlier.len + FakeHeap::PAGE, "a free page between regions");
        }
        let mut out = [0xff; 10];
        memory.read(a.id, 0, &mut out).unwrap();
        assert_eq!(out, [0; 10]);
        assert_eq!(memory.heap().live_bytes(), 10 + FakeHeap::PAGE);
    }

    #[test]
    fn keeps_the_memory_contract_from_a_page_aligned_base() {
        let mut memory = InMemoryMemory::new(FakeHeap::with_base(0x7000_0123));
        let region = memory.allocate(MemoryKind::Host, 16).unwrap();
        assert_eq!(region.addr, 0x7000_0000);
        memory.free(region.id).unwrap();
        kv_core::contract::memory(&mut memory);
        assert_eq!(memory.heap().live_bytes(), 0, "the contract frees what it allocates");
    }

    #[test]
    fn freeing_forgets_regions_and_their_bytes() {
        let mut memory = InMemoryMemory::new(FakeHeap::new());
        let a = memory.allocate(MemoryKind::Host, 8).unwrap();
        let b = memory.allocate(MemoryKind::Host, 8).unwrap();
        memory.free(a.id).unwrap();
        assert_eq!(memory.free(a.id), Err(MemoryError::UnknownRegion(a.id)));
        assert!(!memory.heap().contains(a.addr, 1));
        memory.free_all();
        assert_eq!(memory.regions().count(), 0);
        assert_eq!(memory.heap().live_bytes(), 0);
        assert_eq!(memory.write(b.id, 0, b"x"), Err(MemoryError::UnknownRegion(b.id)));
    }

    #[test]
    fn oversized_allocations_fail_without_allocating() {
        let mut memory = InMemoryMemory::new(FakeHeap::new());
        let err = memory.allocate(MemoryKind::Host, FakeHeap::CAPACITY + 1).unwrap_err();
        assert!(matches!(err, MemoryError::Allocation { len, .. } if len == FakeHeap::CAPACITY + 1), "{err}");
        let mut top = InMemoryMemory::new(FakeHeap::with_base(u64::MAX));
        assert!(matches!(top.allocate(MemoryKind::Host, 1), Err(MemoryError::Allocation { .. })));
    }
}
