//! The agent metadata a [`crate::NixlTransport`] hands its peers, and the memory kind of a
//! descriptor list's ranges.
//!
//! NIXL checks a remote descriptor list against the peer's registrations of the list's memory
//! type and device, so the side that builds the list must know what kind of memory each remote
//! range is: DRAM, or VRAM of which GPU. NIXL's serialized agent holds that, but in a form of
//! NIXL's own; so the handshake's `agent_metadata` is kvflow's registration table
//! ([`kv_core::agent::AgentTable`], transport `"nixl"`), taken at the same moment, then NIXL's
//! bytes.

pub(crate) use kv_core::agent::Registration;
use kv_core::agent::{AgentTable, AgentTableError};
use kv_core::{MemoryKind, TransportError};
use nixl_sys::MemType;

/// The name this transport's tables carry.
const TRANSPORT: &str = "nixl";

/// kvflow's agent metadata: the table of `registrations`, then NIXL's serialized agent.
pub(crate) fn encode(registrations: &[Registration], nixl: &[u8]) -> Result<Vec<u8>, AgentTableError> {
    AgentTable { registrations: registrations.to_vec(), ..AgentTable::new(TRANSPORT) }.encode(nixl)
}

/// A peer's registrations and NIXL's metadata, from what [`encode`] wrote; never panics.
pub(crate) fn decode(bytes: &[u8]) -> Result<(Vec<Registration>, &[u8]), AgentTableError> {
    AgentTable::decode(bytes, TRANSPORT).map(|(table, nixl)| (table.registrations, nixl))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(addr: u64, len: u64, kind: MemoryKind) -> Registration {
        Registration { addr, len, kind }
    }

    #[test]
    fn the_table_and_nixl_bytes_round_trip_and_another_transports_is_refused() {
        let table = [reg(0x1000, 4096, MemoryKind::Host), reg(0x7e00_0000_0000, 256 << 20, MemoryKind::Device(3))];
        let bytes = encode(&table, b"nixl agent").unwrap();
        assert_eq!(decode(&bytes).unwrap(), (table.to_vec(), &b"nixl agent"[..]));
        let tcp = AgentTable::new("tcp").encode(b"").unwrap();
        let err = decode(&tcp).unwrap_err().to_string();
        assert_eq!(err, "agent metadata written by transport \"tcp\", this side runs \"nixl\"");
    }

    #[test]
    fn descriptor_lists_take_one_memory_type_and_each_range_its_device() {
        let table = [
            reg(0, 100, MemoryKind::Host),
            reg(100, 100, MemoryKind::PinnedHost),
            reg(1000, 100, MemoryKind::Device(0)),
            reg(2000, 100, MemoryKind::Device(2)),
        ];
        let lookup = |addr, len| Registration::kind_of(table, addr, len);
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
