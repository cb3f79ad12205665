//! The registered regions, and the only code that touches their bytes.
//!
//! A region's bytes are reached only through [`Registry::with_bytes`] and
//! [`Registry::with_bytes_mut`], which hold that region's read lock for the whole copy;
//! [`Registry::deregister`] takes its write lock after removing it from the table, so once
//! `deregister` returns no thread is copying to or from it, and none will again.
#![allow(unsafe_code)] // Registered memory is the caller's, reached by address: see with_bytes.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, PoisonError, RwLock};

use kv_core::{Region, RegionId};

use crate::metadata::Registration;

/// One registered region and its copy lock: `true` while it is registered.
struct Entry {
    region: Region,
    live: RwLock<bool>,
}

impl Entry {
    fn holds(&self, addr: u64, len: u64) -> bool {
        Registration { addr: self.region.addr, len: self.region.len, kind: self.region.kind }.holds(addr, len)
    }
}

#[derive(Default)]
struct Table {
    /// By first address, then id: two registrations may start at one address.
    by_addr: BTreeMap<(u64, RegionId), Arc<Entry>>,
    ids: HashMap<RegionId, u64>,
}

/// The regions registered with one transport, shared by its threads.
#[derive(Default)]
pub(crate) struct Registry {
    table: RwLock<Table>,
}

impl Registry {
    /// Adds a host region; the error says why it cannot be (reached by address, it must be
    /// a non-null range that fits this machine's address space).
    pub(crate) fn register(&self, region: &Region) -> Result<(), String> {
        let end = region.addr.checked_add(region.len);
        if region.addr == 0 || region.len == 0 || end.is_none_or(|end| end > isize::MAX as u64) {
            return Err(format!(
                "region {:?} at {:#x}+{} is not a non-empty range of this process's address space",
                region.id, region.addr, region.len
            ));
        }
        let mut table = self.table.write().unwrap_or_else(PoisonError::into_inner);
        if table.ids.contains_key(&region.id) {
            return Err(format!("region {:?} is registered already", region.id));
        }
        table.ids.insert(region.id, region.addr);
        let entry = Arc::new(Entry { region: *region, live: RwLock::new(true) });
        table.by_addr.insert((region.addr, region.id), entry);
        Ok(())
    }

    /// Removes a region, and returns once no copy to or from it runs (copies already holding
    /// it finish first; later ones do not find it).
    pub(crate) fn deregister(&self, id: RegionId) -> Option<Region> {
        let entry = {
            let mut table = self.table.write().unwrap_or_else(PoisonError::into_inner);
            let addr = table.ids.remove(&id)?;
            table.by_addr.remove(&(addr, id))?
        };
        *entry.live.write().unwrap_or_else(PoisonError::into_inner) = false;
        Some(entry.region)
    }

    /// What peers learn: every registration, in address order.
    pub(crate) fn table(&self) -> Vec<Registration> {
        let table = self.table.read().unwrap_or_else(PoisonError::into_inner);
        table
            .by_addr
            .values()
            .map(|e| Registration { addr: e.region.addr, len: e.region.len, kind: e.region.kind })
            .collect()
    }

    /// The registration that holds all of `addr..addr + len`, if one does.
    fn find(&self, addr: u64, len: u64) -> Option<Arc<Entry>> {
        let table = self.table.read().unwrap_or_else(PoisonError::into_inner);
        let found = table.by_addr.range(..=(addr, RegionId(u64::MAX))).rev().find(|(_, e)| e.holds(addr, len));
        found.map(|(_, e)| e.clone())
    }

    /// Whether all of `addr..addr + len` lies in one registered region now.
    pub(crate) fn holds(&self, addr: u64, len: u64) -> bool {
        self.find(addr, len).is_some()
    }

    /// Runs `f` on the registered bytes at `addr..addr + len`, holding the region against
    /// `deregister` until `f` returns; `None` (and `f` not run) if they are not registered.
    pub(crate) fn with_bytes<R>(&self, addr: u64, len: usize, f: impl FnOnce(&[u8]) -> R) -> Option<R> {
        let entry = self.find(addr, len as u64)?;
        let live = entry.live.read().unwrap_or_else(PoisonError::into_inner);
        if !*live {
            return None;
        }
        // SAFETY: `addr..addr + len` lies inside a region that is registered now and stays
        // registered while `live` is held (deregister waits for it), and `register`'s caller
        // promised that a registered region is memory of this process, valid for reads and
        // writes, until it is deregistered; `register` checked it is non-null and within
        // isize::MAX. The slice lives only for `f`, which cannot keep it. Other transfers the
        // caller posted may touch the same bytes at the same time, as a NIC's DMA would: the
        // Transport contract leaves overlapping transfers to the caller, and bytes read here
        // are only copied to a socket, never interpreted.
        let bytes = unsafe { std::slice::from_raw_parts(addr as usize as *const u8, len) };
        Some(f(bytes))
    }

    /// Runs `f` on the registered bytes at `addr..addr + len` to fill them, holding the region
    /// against `deregister` until `f` returns; `None` (and `f` not run) if they are not registered.
    pub(crate) fn with_bytes_mut<R>(&self, addr: u64, len: usize, f: impl FnOnce(&mut [u8]) -> R) -> Option<R> {
        let entry = self.find(addr, len as u64)?;
        let live = entry.live.read().unwrap_or_else(PoisonError::into_inner);
        if !*live {
            return None;
        }
        // SAFETY: as in `with_bytes`: the range is inside a region registered for as long as
        // `live` is held, which the caller of `register` promised is valid, writable memory of
        // this process until deregistered. The slice lives only for `f`, which only fills it
        // from a socket. Writing into memory that the engine may also access is what the
        // Transport port is for (a NIC's DMA does the same); the engine must not read a
        // transfer's destination before the transfer reports done, as with NIXL.
        let bytes = unsafe { std::slice::from_raw_parts_mut(addr as usize as *mut u8, len) };
        Some(f(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_core::MemoryKind;

    fn region(id: u64, bytes: &[u8]) -> Region {
        Region { id: RegionId(id), kind: MemoryKind::Host, addr: bytes.as_ptr() as u64, len: bytes.len() as u64 }
    }

    #[test]
    fn bytes_are_reached_only_inside_live_registrations() {
        let mut memory = vec![0u8; 64];
        let registry = Registry::default();
        let r = region(1, &memory);
        registry.register(&r).unwrap();
        assert!(registry.register(&r).unwrap_err().contains("registered already"));
        let base = r.addr;
        assert_eq!(registry.with_bytes_mut(base + 8, 4, |b| b.copy_from_slice(b"kvkv")), Some(()));
        assert_eq!(registry.with_bytes(base + 6, 8, <[u8]>::to_vec), Some(b"\0\0kvkv\0\0".to_vec()));
        assert!(registry.with_bytes(base + 60, 5, |_| ()).is_none(), "runs off the end");
        assert!(registry.holds(base, 64) && !registry.holds(base - 1, 2));
        assert_eq!(registry.table().len(), 1);
        assert_eq!(registry.deregister(r.id), Some(r));
        assert_eq!(registry.deregister(r.id), None);
        assert!(registry.with_bytes_mut(base, 1, |b| b[0] = 1).is_none(), "deregistered");
        assert_eq!(&memory[8..12], b"kvkv");
        memory[0] = 0;
        let null = Region { id: RegionId(2), kind: MemoryKind::Host, addr: 0, len: 8 };
        assert!(registry.register(&null).unwrap_err().contains("not a non-empty range"));
    }
}
