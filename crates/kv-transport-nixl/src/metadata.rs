//! The agent metadata a [`crate::NixlTransport`] hands its peers, and the memory kind of a
//! descriptor list's ranges.
//!
//! NIXL checks a remote descriptor list against the peer's registrations of the list's memory
//! type and device, so the side that builds the list must know what kind of memory each remote
//! range is: DRAM, or VRAM of which GPU. NIXL's serialized agent holds that, but in a form of
//! NIXL's own; so the handshake's `agent_metadata` carries kvflow's table of the sender's
//! registrations ahead of NIXL's bytes, taken at the same moment:
//!
//! ```text
//! "KVNX" | version u8 | count u32 | count x (addr u64, len u64, kind u8, device u32) | NIXL's metadata
//! ```
//!
//! Integers are little-endian; kind is 0 for pageable host memory, 1 for pinned host memory and
//! 2 for device memory. kv-core sees the field as opaque bytes; only this module reads it.

use kv_core::{MemoryKind, TransportError};
use nixl_sys::MemType;

/// The first bytes of kvflow's agent metadata.
const MAGIC: &[u8; 4] = b"KVNX";
/// The layout of the table this module writes.
const VERSION: u8 = 1;
/// Bytes of one table entry.
const ENTRY_BYTES: usize = 8 + 8 + 1 + 4;
/// Bytes before the first entry.
const HEADER_BYTES: usize = MAGIC.len() + 1 + 4;

/// A registered range of memory, local or a peer's.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Registration {
    /// Its first byte.
    pub(crate) addr: u64,
    /// Its length in bytes.
    pub(crate) len: u64,
    /// What memory it is.
    pub(crate) kind: MemoryKind,
}

/// The kind of the registration that holds all of `addr..addr + len`, if one does.
pub(crate) fn kind_of(
    registrations: impl IntoIterator<Item = Registration>,
    addr: u64,
    len: u64,
) -> Option<MemoryKind> {
    let end = addr.checked_add(len)?;
    registrations
        .into_iter()
        .find(|r| r.addr <= addr && r.addr.checked_add(r.len).is_some_and(|e| end <= e))
        .map(|r| r.kind)
}

/// NIXL's memory type for a kind: host memory (pinned or not) is DRAM, a GPU's is VRAM.
pub(crate) fn mem_type(kind: MemoryKind) -> MemType {
    match kind {
        MemoryKind::Host | MemoryKind::PinnedHost => MemType::Dram,
        MemoryKind::Device(_) => MemType::Vram,
    }
}

/// A descriptor list's memory type, and its ranges with the device id each was registered with.
#[derive(Clone, PartialEq, Eq, Debug)]
pub(crate) struct TypedRanges {
    /// The one memory type of every range.
    pub(crate) mem_type: MemType,
    /// `(address, length, device id)` per range, in order.
    pub(crate) ranges: Vec<(u64, u64, u64)>,
}

/// Types `ranges` by the registrations that hold them (`lookup`); `side` names them in errors.
///
/// A NIXL descriptor list has one memory type, so ranges of DRAM and VRAM cannot share one; the
/// GPUs of VRAM ranges may differ, each range carrying its own device id.
pub(crate) fn typed_ranges(
    side: &'static str,
    ranges: impl IntoIterator<Item = (u64, u64)>,
    lookup: impl Fn(u64, u64) -> Option<MemoryKind>,
) -> Result<TypedRanges, TransportError> {
    let mut first: Option<MemoryKind> = None;
    let mut typed = Vec::new();
    for (addr, len) in ranges {
        if len == 0 {
            return Err(TransportError::InvalidTransfer(format!("a {side} range of 0 bytes")));
        }
        let kind = lookup(addr, len).ok_or(TransportError::NotRegistered { side, addr, len })?;
        match first {
            None => first = Some(kind),
            Some(seen) if mem_type(seen) != mem_type(kind) => {
                return Err(TransportError::InvalidTransfer(format!(
                    "{side} ranges lie in {seen:?} and {kind:?} memory; one NIXL transfer names one memory type \
                     per side, so post them separately"
                )));
            }
            Some(_) => {}
        }
        typed.push((addr, len, u64::from(kind.device_id())));
    }
    let kind = first.ok_or_else(|| TransportError::InvalidTransfer(format!("no {side} ranges")))?;
    Ok(TypedRanges { mem_type: mem_type(kind), ranges: typed })
}

/// kvflow's agent metadata: the table of `registrations`, then NIXL's serialized agent.
pub(crate) fn encode(registrations: &[Registration], nixl: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_BYTES + registrations.len() * ENTRY_BYTES + nixl.len());
    out.extend_from_slice(MAGIC);
    out.push(VERSION);
    out.extend_from_slice(&(registrations.len() as u32).to_le_bytes());
    for r in registrations {
        let (tag, device) = match r.kind {
            MemoryKind::Host => (0u8, 0u32),
            MemoryKind::PinnedHost => (1, 0),
            MemoryKind::Device(ordinal) => (2, ordinal),
        };
        out.extend_from_slice(&r.addr.to_le_bytes());
        out.extend_from_slice(&r.len.to_le_bytes());
        out.push(tag);
        out.extend_from_slice(&device.to_le_bytes());
    }
    out.extend_from_slice(nixl);
    out
}

/// A peer's registrations and NIXL's metadata, from what [`encode`] wrote; never panics.
pub(crate) fn decode(bytes: &[u8]) -> Result<(Vec<Registration>, &[u8]), String> {
    let rest = bytes.strip_prefix(MAGIC.as_slice()).ok_or_else(|| {
        "agent metadata does not start with kvflow's registration table (a peer of another kvflow version?)".to_owned()
    })?;
    let (&version, rest) = rest.split_first().ok_or("agent metadata ends before its version")?;
    if version != VERSION {
        return Err(format!("agent metadata table version {version}, this side reads version {VERSION}"));
    }
    let count = rest.get(..4).ok_or("agent metadata ends before its registration count")?;
    let count = u32::from_le_bytes([count[0], count[1], count[2], count[3]]) as usize;
    let rest = &rest[4..];
    let table_bytes = count
        .checked_mul(ENTRY_BYTES)
        .filter(|&n| n <= rest.len())
        .ok_or_else(|| format!("agent metadata lists {count} registrations but holds only {} bytes", rest.len()))?;
    let (table, nixl) = rest.split_at(table_bytes);
    let mut registrations = Vec::with_capacity(count);
    for entry in table.chunks_exact(ENTRY_BYTES) {
        let u64_at = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&entry[at..at + 8]);
            u64::from_le_bytes(b)
        };
        let device = u32::from_le_bytes([entry[17], entry[18], entry[19], entry[20]]);
        let kind = match entry[16] {
            0 => MemoryKind::Host,
            1 => MemoryKind::PinnedHost,
            2 => MemoryKind::Device(device),
            tag => return Err(format!("agent metadata names memory kind {tag}, which this side does not know")),
        };
        registrations.push(Registration { addr: u64_at(0), len: u64_at(8), kind });
    }
    Ok((registrations, nixl))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(addr: u64, len: u64, kind: MemoryKind) -> Registration {
        Registration { addr, len, kind }
    }

    #[test]
    fn the_table_and_nixl_bytes_round_trip() {
        let table = [
            reg(0x1000, 4096, MemoryKind::Host),
            reg(0x7f00_0000_0000, 1 << 30, MemoryKind::PinnedHost),
            reg(0x7e00_0000_0000, 256 << 20, MemoryKind::Device(3)),
        ];
        let bytes = encode(&table, b"nixl agent");
        assert_eq!(bytes.len(), HEADER_BYTES + 3 * ENTRY_BYTES + 10);
        let (decoded, nixl) = decode(&bytes).unwrap();
        assert_eq!(decoded, table);
        assert_eq!(nixl, b"nixl agent");
        assert_eq!(decode(&encode(&[], b"")).unwrap(), (Vec::new(), &b""[..]));
    }

    #[test]
    fn bad_metadata_is_an_error_that_says_why() {
        let good = encode(&[reg(0, 8, MemoryKind::Device(1))], b"md");
        let check = |bytes: &[u8], expected: &str| {
            let err = decode(bytes).unwrap_err();
            assert!(err.contains(expected), "{err:?} does not say {expected:?}");
        };
        check(b"", "does not start with kvflow's registration table");
        check(b"NIXL metadata of an older kvflow", "does not start with kvflow's registration table");
        check(b"KVNX", "ends before its version");
        check(b"KVNX\x02", "table version 2, this side reads version 1");
        check(b"KVNX\x01\x01", "ends before its registration count");
        check(b"KVNX\x01\xff\xff\xff\xff", "lists 4294967295 registrations but holds only 0 bytes");
        check(&good[..good.len() - 3], "lists 1 registrations but holds only 20 bytes");
        let mut unknown = good.clone();
        unknown[HEADER_BYTES + 16] = 9;
        check(&unknown, "memory kind 9");
        // Every truncation of good metadata is an error or a shorter NIXL tail, never a panic.
        for cut in 0..good.len() {
            let _ = decode(&good[..cut]);
        }
    }

    #[test]
    fn a_range_takes_the_kind_of_the_registration_that_holds_all_of_it() {
        let table = [reg(1000, 100, MemoryKind::Host), reg(2000, 100, MemoryKind::Device(1))];
        let kind = |addr, len| kind_of(table, addr, len);
        assert_eq!(kind(1000, 100), Some(MemoryKind::Host));
        assert_eq!(kind(2050, 50), Some(MemoryKind::Device(1)));
        assert_eq!(kind(2050, 51), None, "runs off the end");
        assert_eq!(kind(999, 2), None, "starts before");
        assert_eq!(kind(1050, 1000), None, "spans two registrations");
        assert_eq!(kind(u64::MAX, 2), None, "overflows");
    }

    #[test]
    fn descriptor_lists_take_one_memory_type_and_each_range_its_device() {
        let table = [
            reg(0, 100, MemoryKind::Host),
            reg(100, 100, MemoryKind::PinnedHost),
            reg(1000, 100, MemoryKind::Device(0)),
            reg(2000, 100, MemoryKind::Device(2)),
        ];
        let lookup = |addr, len| kind_of(table, addr, len);
        let typed = typed_ranges("remote", [(10, 10), (150, 50)], lookup).unwrap();
        assert_eq!(typed, TypedRanges { mem_type: MemType::Dram, ranges: vec![(10, 10, 0), (150, 50, 0)] });
        let typed = typed_ranges("remote", [(1000, 100), (2010, 10)], lookup).unwrap();
        assert_eq!(typed, TypedRanges { mem_type: MemType::Vram, ranges: vec![(1000, 100, 0), (2010, 10, 2)] });
        let err = |ranges: &[(u64, u64)]| typed_ranges("remote", ranges.iter().copied(), lookup).unwrap_err();
        assert_eq!(err(&[(500, 8)]), TransportError::NotRegistered { side: "remote", addr: 500, len: 8 });
        assert_eq!(err(&[(0, 0)]), TransportError::InvalidTransfer("a remote range of 0 bytes".into()));
        assert_eq!(err(&[]), TransportError::InvalidTransfer("no remote ranges".into()));
        let mixed = err(&[(0, 8), (1000, 8)]).to_string();
        assert!(mixed.contains("remote ranges lie in Host and Device(0) memory"), "{mixed}");
    }
}
