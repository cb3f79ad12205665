//! [`CudaMemory`]: kv-core's [`Memory`] port over host memory and the CUDA driver.

use std::collections::BTreeMap;
use std::sync::Arc;

use kv_core::{Memory, MemoryError, MemoryKind, Region, RegionId};

use crate::driver::{self, Allocation, Context};

/// The device whose context allocates pinned host memory (which is pinned for every context).
const PINNED_DEVICE: u32 = 0;

/// KV pool memory of every [`MemoryKind`]: pageable host memory mapped anonymously (from 2 MiB
/// on, aligned to 2 MiB and advised onto transparent huge pages, which makes the kernel's
/// cross-process copy about twice as fast), page-locked host memory from `cuMemHostAlloc`, and
/// device memory from `cuMemAlloc` on the GPU the kind names. Regions are zeroed when allocated
/// and host regions are page-aligned.
///
/// Each [`Region`] it hands out is what a transport registers: `kind` says DRAM (host, pinned
/// or not) or VRAM and the device id (the GPU's ordinal), and `addr` is a host address or a
/// device address. Host pools need nothing CUDA; pinned and device pools need the CUDA driver
/// and a device, and without them allocation fails with [`MemoryError::Unavailable`], saying
/// why. The driver is loaded on first need, so a host-only pool never touches it.
///
/// Bytes that a transport moves land behind this type's back: read a region only once the
/// transfers that write it are complete.
#[derive(Debug, Default)]
pub struct CudaMemory {
    regions: BTreeMap<RegionId, (Region, Allocation)>,
    contexts: BTreeMap<u32, Arc<Context>>,
    next_id: u64,
}

impl CudaMemory {
    /// An empty pool memory; nothing CUDA is loaded until a pinned or device region is asked for.
    pub fn new() -> Self {
        CudaMemory::default()
    }

    /// The regions allocated and not freed, by id.
    pub fn regions(&self) -> impl Iterator<Item = &Region> + '_ {
        self.regions.values().map(|(region, _)| region)
    }

    /// Copies `len` bytes from `src` at `src_offset` to `dst` at `dst_offset`, between regions of
    /// any kinds (device to device stays on the GPU), and returns once the bytes are there.
    /// Within one region the ranges may overlap, except in device memory.
    pub fn copy(
        &mut self,
        dst: RegionId,
        dst_offset: u64,
        src: RegionId,
        src_offset: u64,
        len: u64,
    ) -> Result<(), MemoryError> {
        let src_at = self.locate(src, src_offset, len)?;
        let dst_at = self.locate(dst, dst_offset, len)?;
        // `locate` checked both ranges against lengths that fit in usize.
        let len = len as usize;
        if src == dst {
            let (region, allocation) = self.regions.get_mut(&dst).ok_or(MemoryError::UnknownRegion(dst))?;
            return driver::copy_within(allocation, dst_at, src_at, len).map_err(|reason| failed(region, reason));
        }
        let (src_region, src_allocation) = self.regions.remove(&src).ok_or(MemoryError::UnknownRegion(src))?;
        let result = match self.regions.get_mut(&dst) {
            Some((dst_region, dst_allocation)) => {
                driver::copy(dst_allocation, dst_at, &src_allocation, src_at, len).map_err(|reason| {
                    // Only the driver fails a copy: blame the device side.
                    let kind = [dst_region.kind, src_region.kind]
                        .into_iter()
                        .find(|k| matches!(k, MemoryKind::Device(_)))
                        .unwrap_or(dst_region.kind);
                    MemoryError::Unavailable { kind, reason }
                })
            }
            None => Err(MemoryError::UnknownRegion(dst)),
        };
        self.regions.insert(src, (src_region, src_allocation));
        result
    }

    /// The retained context of device `ordinal`, retained on first use.
    fn context(&mut self, kind: MemoryKind, ordinal: u32) -> Result<Arc<Context>, MemoryError> {
        if let Some(ctx) = self.contexts.get(&ordinal) {
            return Ok(ctx.clone());
        }
        let ctx = Arc::new(Context::retain(ordinal).map_err(|reason| MemoryError::Unavailable { kind, reason })?);
        self.contexts.insert(ordinal, ctx.clone());
        Ok(ctx)
    }

    /// The offset of `offset..offset + len` in `region`, checked against the region's bounds.
    fn locate(&self, region: RegionId, offset: u64, len: u64) -> Result<usize, MemoryError> {
        let (found, _) = self.regions.get(&region).ok_or(MemoryError::UnknownRegion(region))?;
        match offset.checked_add(len) {
            // A region's length fits in usize (it was allocated), so its offsets do too.
            Some(end) if end <= found.len => Ok(offset as usize),
            _ => Err(MemoryError::OutOfBounds { region, offset, len, region_len: found.len }),
        }
    }
}

/// A driver failure on a region's bytes: the memory of that kind cannot serve the operation.
fn failed(region: &Region, reason: String) -> MemoryError {
    MemoryError::Unavailable { kind: region.kind, reason }
}

impl Memory for CudaMemory {
    fn allocate(&mut self, kind: MemoryKind, len: u64) -> Result<Region, MemoryError> {
        let refuse = |reason: String| MemoryError::Allocation { kind, len, reason };
        if len == 0 {
            return Err(refuse("a region of 0 bytes cannot be registered with a transport".into()));
        }
        let bytes = usize::try_from(len).map_err(|_| refuse("more bytes than this machine addresses".into()))?;
        let allocation = match kind {
            MemoryKind::Host => Allocation::host(bytes).map_err(refuse)?,
            MemoryKind::PinnedHost => {
                let ctx = self.context(kind, PINNED_DEVICE).map_err(|e| match e {
                    MemoryError::Unavailable { kind, reason } => MemoryError::Unavailable {
                        kind,
                        reason: format!("pinned host memory needs the CUDA driver and a device: {reason}"),
                    },
                    other => other,
                })?;
                Allocation::pinned(bytes, ctx).map_err(refuse)?
            }
            MemoryKind::Device(ordinal) => {
                let ctx = self.context(kind, ordinal)?;
                Allocation::device(bytes, ctx).map_err(refuse)?
            }
        };
        let region = Region { id: RegionId(self.next_id), kind, addr: allocation.addr(), len };
        self.next_id += 1;
        tracing::debug!(?region, "allocated");
        self.regions.insert(region.id, (region, allocation));
        Ok(region)
    }

    fn free(&mut self, region: RegionId) -> Result<(), MemoryError> {
        // Dropping the allocation frees it.
        self.regions.remove(&region).map(drop).ok_or(MemoryError::UnknownRegion(region))
    }

    fn read(&self, region: RegionId, offset: u64, out: &mut [u8]) -> Result<(), MemoryError> {
        let at = self.locate(region, offset, out.len() as u64)?;
        let (found, allocation) = self.regions.get(&region).ok_or(MemoryError::UnknownRegion(region))?;
        allocation.read(at, out).map_err(|reason| failed(found, reason))
    }

    fn write(&mut self, region: RegionId, offset: u64, data: &[u8]) -> Result<(), MemoryError> {
        let at = self.locate(region, offset, data.len() as u64)?;
        let (found, allocation) = self.regions.get_mut(&region).ok_or(MemoryError::UnknownRegion(region))?;
        allocation.write(at, data).map_err(|reason| failed(found, reason))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_regions_are_zeroed_page_aligned_and_apart() {
        let mut memory = CudaMemory::new();
        let a = memory.allocate(MemoryKind::Host, 10).unwrap();
        let b = memory.allocate(MemoryKind::Host, 3 * driver::PAGE as u64).unwrap();
        assert_eq!((a.kind, a.len), (MemoryKind::Host, 10));
        assert_ne!(a.id, b.id);
        for region in [a, b] {
            assert_eq!(region.addr % driver::PAGE as u64, 0, "{region:?}");
            let mut out = vec![0xff; region.len as usize];
            memory.read(region.id, 0, &mut out).unwrap();
            assert!(out.iter().all(|&byte| byte == 0), "{region:?} is not zeroed");
        }
        assert!(a.addr + a.len <= b.addr || b.addr + b.len <= a.addr, "{a:?} and {b:?} overlap");
        assert_eq!(memory.regions().count(), 2);
    }

    #[test]
    fn large_host_regions_start_on_a_huge_page_and_hold_every_byte() {
        let mut memory = CudaMemory::new();
        // Not a multiple of a page: the last byte is still the region's.
        let len = 3 * driver::HUGE_PAGE as u64 + 5;
        let region = memory.allocate(MemoryKind::Host, len).unwrap();
        assert_eq!(region.addr % driver::HUGE_PAGE as u64, 0, "{region:?}");
        let mut out = vec![0xff; len as usize];
        memory.read(region.id, 0, &mut out).unwrap();
        assert!(out.iter().all(|&byte| byte == 0), "{region:?} is not zeroed");
        memory.write(region.id, len - 3, b"end").unwrap();
        let mut tail = [0; 3];
        memory.read(region.id, len - 3, &mut tail).unwrap();
        assert_eq!(&tail, b"end");
        memory.free(region.id).unwrap();
        // Too large for the address space: an error that names the size, not a panic.
        let err = memory.allocate(MemoryKind::Host, u64::MAX - 10).unwrap_err();
        assert!(err.to_string().contains(&(u64::MAX - 10).to_string()), "{err}");
    }

    #[test]
    fn host_memory_keeps_the_memory_contract() {
        let mut memory = CudaMemory::new();
        kv_core::contract::memory(&mut memory);
        assert_eq!(memory.regions().count(), 0, "the contract frees what it allocates");
    }

    #[test]
    fn empty_and_unaddressable_regions_are_refused() {
        let mut memory = CudaMemory::new();
        for kind in [MemoryKind::Host, MemoryKind::PinnedHost, MemoryKind::Device(0)] {
            let err = memory.allocate(kind, 0).unwrap_err();
            assert!(matches!(err, MemoryError::Allocation { len: 0, .. }), "{kind:?}: {err}");
        }
        let err = memory.allocate(MemoryKind::Host, u64::MAX).unwrap_err();
        assert!(matches!(err, MemoryError::Allocation { len: u64::MAX, .. }), "{err}");
    }

    #[test]
    fn host_copies_between_and_within_regions() {
        let mut memory = CudaMemory::new();
        let a = memory.allocate(MemoryKind::Host, 8).unwrap();
        let b = memory.allocate(MemoryKind::Host, 8).unwrap();
        memory.write(a.id, 0, b"abcdefgh").unwrap();
        memory.copy(b.id, 2, a.id, 0, 4).unwrap();
        let mut out = [0; 8];
        memory.read(b.id, 0, &mut out).unwrap();
        assert_eq!(&out, b"\0\0abcd\0\0");
        // Overlapping, within one region.
        memory.copy(a.id, 2, a.id, 0, 6).unwrap();
        memory.read(a.id, 0, &mut out).unwrap();
        assert_eq!(&out, b"ababcdef");
        let out_of_bounds = MemoryError::OutOfBounds { region: b.id, offset: 6, len: 4, region_len: 8 };
        assert_eq!(memory.copy(b.id, 6, a.id, 0, 4), Err(out_of_bounds));
        assert_eq!(memory.copy(RegionId(99), 0, a.id, 0, 1), Err(MemoryError::UnknownRegion(RegionId(99))));
        assert_eq!(memory.regions().count(), 2, "a failed copy keeps both regions");
    }

    #[test]
    fn cuda_kinds_without_a_driver_or_device_are_unavailable_and_say_why() {
        let mut memory = CudaMemory::new();
        match driver::device_count() {
            Ok(count) if count > 0 => {
                // A GPU machine: pinned memory works, and a device that is not there is named.
                let pinned = memory.allocate(MemoryKind::PinnedHost, 4096).unwrap();
                assert_eq!(pinned.kind, MemoryKind::PinnedHost);
                let err = memory.allocate(MemoryKind::Device(count), 4096).unwrap_err();
                let expected = format!("there is no CUDA device {count}: this machine has {count}");
                assert!(err.to_string().contains(&expected), "{err}");
            }
            Ok(_) | Err(_) => {
                let why = driver::device_count().err().unwrap_or_else(|| "there is no CUDA device 0".into());
                for kind in [MemoryKind::PinnedHost, MemoryKind::Device(0)] {
                    match memory.allocate(kind, 4096) {
                        Err(MemoryError::Unavailable { kind: k, reason }) => {
                            assert_eq!(k, kind);
                            assert!(reason.contains(&why), "{kind:?}: {reason:?} does not say {why:?}");
                        }
                        other => panic!("{kind:?}: expected Unavailable, got {other:?}"),
                    }
                }
                // Host memory is still there.
                memory.allocate(MemoryKind::Host, 4096).unwrap();
            }
        }
    }
}
