//! Wire messages between P and D, with a versioned codec and a size limit.
//!
//! These are the only serialized domain types. Every frame is `b"KV"`, the protocol version
//! as two big-endian bytes, then the message in postcard (a compact, canonical serde format).
//! Decoding any bytes gives a value or a [`WireError`], never a panic, and never allocates more
//! than the frame's size limit allows.

use serde::{Deserialize, Serialize};

use crate::id::{AgentName, BlockId, EngineId, RequestId, MAX_REQUEST_ID_LEN};
use crate::layout::KvLayout;
use crate::plan::RegionBase;
use crate::prompt::{Digest, Prompt};
use crate::time::Time;

/// The protocol version this build speaks. 4: D claims an export with [`Message::Claim`],
/// naming the prompt and P's blocks it loads for, P may answer [`LeaseState::Refused`], and a
/// push registration names its prompt; 3 carried the layout's element format
/// ([`crate::Dtype`]) where 2 carried only its size in bytes.
pub const PROTOCOL_VERSION: u16 = 4;

/// The largest notification frame kvflow sends or accepts, in bytes.
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024;

/// The largest handshake frame kvflow sends or accepts (agent metadata can be large).
pub const MAX_HANDSHAKE_BYTES: usize = 4 * 1024 * 1024;

const MAGIC: [u8; 2] = *b"KV";
const HEADER_LEN: usize = 4;

/// A notification between a P rank and a D rank.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub enum Message {
    /// D finished reading (or needs nothing: a prefix hit); P counts it toward the export's consumers.
    /// In push mode, P's write carries it to D.
    Completion {
        /// The receiver's request id.
        request: RequestId,
        /// Completions the receiver waits for in all, as the sender computed it.
        expected_consumers: u32,
    },
    /// D renews the leases of requests waiting in its queue.
    Heartbeat {
        /// P's request ids.
        requests: Vec<RequestId>,
    },
    /// P's answer to a heartbeat: each id's new deadline, so D knows how long a read is safe.
    HeartbeatAck {
        /// One entry per id of the heartbeat.
        renewals: Vec<Renewal>,
    },
    /// D rejected the request before admission; P frees its export at once.
    Rejection {
        /// P's request id.
        request: RequestId,
    },
    /// D gave up the request (aborted, or its load failed); P frees its export.
    Abort {
        /// P's request id.
        request: RequestId,
    },
    /// Push mode: D's blocks for a request, for P to write into.
    PushRegistration(PushRegistration),
    /// D claims an export for its engine: sent on arrival, and in place of each renewal until
    /// P answers it `Held`. P binds the export to the sender only if the claim names the prompt
    /// (and, where it names them, the blocks) P computed; otherwise it releases the export
    /// (`rejected`) and answers `Refused`.
    Claim(Claim),
}

/// D's claim of one export.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct Claim {
    /// P's request id.
    pub request: RequestId,
    /// D's own prompt (its length, and its tokens' digest where D has them).
    pub prompt: Prompt,
    /// [`Digest::of_blocks`] of the P blocks D will read, as the handoff named them: `None`
    /// in push mode, where P writes from its own blocks.
    pub blocks: Option<Digest>,
}

/// P's answer for one request id of a heartbeat.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct Renewal {
    /// P's request id, as the heartbeat named it.
    pub request: RequestId,
    /// Where P's export stands.
    pub lease: LeaseState,
}

/// Where an export stands on the P rank that answers a heartbeat.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub enum LeaseState {
    /// P holds it, bound to the heartbeat's engine, until this deadline on P's clock.
    Held(Time),
    /// P released it (or its lease has run out): it must not be read.
    Released,
    /// P's worker does not know it yet (it learns of exports a step after they finish), or
    /// cannot say yet: in push mode, a write into the asking rank's blocks is in flight, and
    /// its completion will answer.
    Unknown,
    /// The claim names another prompt, or other blocks, than P's export: P released it
    /// (`rejected`), and D must not load it.
    Refused,
}

/// Push mode: D's registration of the blocks it allocated for a request.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct PushRegistration {
    /// D's request id: P's write and its answers name it.
    pub request: RequestId,
    /// P's request id as D's handoff names it (P matches it exactly, as a transfer id, then by
    /// base id).
    pub export: RequestId,
    /// The registering D engine.
    pub decode_engine: EngineId,
    /// The registering D rank.
    pub decode_rank: u32,
    /// D's TP size.
    pub decode_tp: u32,
    /// D's blocks, in prompt order, from the prompt's block `first_block` on.
    pub blocks: Vec<BlockId>,
    /// How many of the prompt's first D blocks D's own prefix cache holds: P writes only the
    /// blocks after them (a partial prefix hit), 0 for a whole prompt.
    pub first_block: u32,
    /// P's pipeline-parallel size as D took it from P's handshakes: D registers with every
    /// stage and waits for each one's write (`prefill_pp * max(1, p_tp / d_tp)` completions
    /// per D rank). P refuses a registration whose count is not its own.
    pub prefill_pp: u32,
    /// D's prompt: P writes only into the blocks of a registration whose prompt is the one it
    /// computed, and answers any other with `Abort`, releasing its export (`rejected`).
    pub prompt: Prompt,
}

/// What each side of a side-channel handshake tells the other.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct Handshake {
    /// The sender's protocol version.
    pub protocol_version: u16,
    /// The sender's engine.
    pub engine: EngineId,
    /// The sender's rank among its engine's workers: `pp_rank * tp_size + tp_rank`, as
    /// vLLM numbers its global ranks (the TP rank itself when the engine has one stage).
    pub rank: u32,
    /// The sender's TP size.
    pub tp_size: u32,
    /// The sender engine's pipeline-parallel size: its stages split the model's layers evenly,
    /// and stage `s` holds layers `s * L / pp_size ..`. Decode engines have one stage.
    pub pp_size: u32,
    /// The sender engine's incarnation: a restarted engine has a new one, and D never loads
    /// an export from an incarnation other than the one that made it.
    pub instance: u64,
    /// `"prefill"` or `"decode"` role of the sender.
    pub role: Role,
    /// The model the sender serves.
    pub model: String,
    /// The sender's KV layout (its block size included).
    pub layout: KvLayout,
    /// Blocks in the sender's pool.
    pub num_blocks: u32,
    /// The sender's pool regions.
    pub regions: Vec<RegionBase>,
    /// [`compatibility_hash`] of the sender's model and layout.
    pub compat_hash: u64,
    /// The sender's clock when it sent this, for the clock offset.
    pub clock: Time,
    /// The transport's agent metadata (NIXL's serialized agent), opaque here.
    pub agent_metadata: Vec<u8>,
}

/// Which side of disaggregation an engine serves.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum Role {
    /// Runs prompts and exports their KV.
    Prefill,
    /// Loads exported KV and generates.
    Decode,
}

/// Why bytes did not decode, or a value did not encode.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum WireError {
    /// The frame is larger than its limit.
    #[error("frame of {len} bytes exceeds the {max}-byte limit")]
    Oversized {
        /// Bytes in the frame.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The frame does not start with kvflow's magic bytes.
    #[error("not a kvflow frame (starts with {found:02x?})")]
    BadMagic {
        /// Up to the first four bytes.
        found: Vec<u8>,
    },
    /// The frame's protocol version is not this build's.
    #[error("protocol version mismatch: peer {peer}, local {local}")]
    Version {
        /// The frame's version.
        peer: u16,
        /// This build's.
        local: u16,
    },
    /// The body is not a valid message.
    #[error("malformed {what}: {reason}")]
    Malformed {
        /// `"message"`, `"handshake"` or `"agent metadata"`.
        what: &'static str,
        /// The decoder's account.
        reason: String,
    },
    /// A request id is longer than [`MAX_REQUEST_ID_LEN`].
    #[error("request id of {len} bytes exceeds the {max}-byte limit")]
    RequestIdTooLong {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
}

impl Message {
    /// Encodes the message as one frame; fails when it would exceed [`MAX_MESSAGE_BYTES`]
    /// (split a long heartbeat instead).
    pub fn encode(&self) -> Result<Vec<u8>, WireError> {
        self.request_ids().try_for_each(check_request_id)?;
        encode_frame(self, MAX_MESSAGE_BYTES, "message")
    }

    /// Decodes one frame.
    pub fn decode(bytes: &[u8]) -> Result<Message, WireError> {
        let message: Message = decode_frame(bytes, MAX_MESSAGE_BYTES, "message")?;
        message.request_ids().try_for_each(check_request_id)?;
        Ok(message)
    }

    /// The request a frame completes, if it decodes to a [`Message::Completion`]: what a
    /// transfer's notification names (P's request for D's reads, D's for P's push writes).
    pub fn completed_request(bytes: &[u8]) -> Option<RequestId> {
        match Message::decode(bytes) {
            Ok(Message::Completion { request, .. }) => Some(request),
            _ => None,
        }
    }

    fn request_ids(&self) -> Box<dyn Iterator<Item = &RequestId> + '_> {
        match self {
            Message::Completion { request, .. } | Message::Rejection { request } | Message::Abort { request } => {
                Box::new(std::iter::once(request))
            }
            Message::Heartbeat { requests } => Box::new(requests.iter()),
            Message::HeartbeatAck { renewals } => Box::new(renewals.iter().map(|r| &r.request)),
            Message::PushRegistration(reg) => Box::new([&reg.request, &reg.export].into_iter()),
            Message::Claim(claim) => Box::new(std::iter::once(&claim.request)),
        }
    }
}

impl Handshake {
    /// The offer of `agent`, a rank of a `tp_size`-wide engine, incarnation `instance`,
    /// serving `model` in `layout` as `role`, with the protocol version and the compatibility
    /// hash, and no pool yet (no blocks, no regions: set them for a rank that has one). The
    /// transport stamps the clock and adds its agent metadata when it sends the offer.
    pub fn new(agent: &AgentName, tp_size: u32, instance: u64, role: Role, model: &str, layout: KvLayout) -> Self {
        Handshake {
            protocol_version: PROTOCOL_VERSION,
            engine: agent.engine.clone(),
            rank: agent.rank,
            tp_size,
            pp_size: 1,
            instance,
            role,
            model: model.to_owned(),
            layout,
            num_blocks: 0,
            regions: Vec::new(),
            compat_hash: compatibility_hash(model, &layout),
            clock: Time::ZERO,
            agent_metadata: Vec::new(),
        }
    }

    /// The sender's rank within its pipeline stage's TP group.
    pub fn tp_rank(&self) -> u32 {
        self.rank % self.tp_size.max(1)
    }

    /// The sender's pipeline stage.
    pub fn pp_rank(&self) -> u32 {
        self.rank / self.tp_size.max(1)
    }

    /// Every worker of the sender's engine: `tp_size * pp_size`.
    pub fn workers(&self) -> u32 {
        self.tp_size.saturating_mul(self.pp_size)
    }

    /// Encodes the handshake as one frame.
    pub fn encode(&self) -> Result<Vec<u8>, WireError> {
        encode_frame(self, MAX_HANDSHAKE_BYTES, "handshake")
    }

    /// Decodes one handshake frame; its `protocol_version` must be the frame header's.
    pub fn decode(bytes: &[u8]) -> Result<Handshake, WireError> {
        let handshake: Handshake = decode_frame(bytes, MAX_HANDSHAKE_BYTES, "handshake")?;
        if handshake.protocol_version != PROTOCOL_VERSION {
            return Err(WireError::Malformed {
                what: "handshake",
                reason: format!(
                    "protocol_version {} in a frame of version {PROTOCOL_VERSION}",
                    handshake.protocol_version
                ),
            });
        }
        Ok(handshake)
    }
}

fn check_request_id(id: &RequestId) -> Result<(), WireError> {
    let len = id.as_str().len();
    if len > MAX_REQUEST_ID_LEN {
        return Err(WireError::RequestIdTooLong { len, max: MAX_REQUEST_ID_LEN });
    }
    Ok(())
}

/// `value` in a frame of `what`: the magic, the protocol version, then postcard; at most `max`
/// bytes.
pub(crate) fn encode_frame<T: Serialize>(value: &T, max: usize, what: &'static str) -> Result<Vec<u8>, WireError> {
    let mut frame = Vec::with_capacity(64);
    frame.extend_from_slice(&MAGIC);
    frame.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
    let frame = postcard::to_extend(value, frame).map_err(|e| WireError::Malformed { what, reason: e.to_string() })?;
    if frame.len() > max {
        return Err(WireError::Oversized { len: frame.len(), max });
    }
    Ok(frame)
}

fn decode_frame<T: for<'de> Deserialize<'de>>(bytes: &[u8], max: usize, what: &'static str) -> Result<T, WireError> {
    let (value, rest) = take_frame(bytes, max, what)?;
    if !rest.is_empty() {
        return Err(WireError::Malformed { what, reason: format!("{} trailing bytes", rest.len()) });
    }
    Ok(value)
}

/// The value a frame of `what` at the front of `bytes` holds, and the bytes after it.
pub(crate) fn take_frame<'a, T: for<'de> Deserialize<'de>>(
    bytes: &'a [u8],
    max: usize,
    what: &'static str,
) -> Result<(T, &'a [u8]), WireError> {
    if bytes.len() > max {
        return Err(WireError::Oversized { len: bytes.len(), max });
    }
    if bytes.len() < HEADER_LEN || bytes[..2] != MAGIC {
        return Err(WireError::BadMagic { found: bytes[..bytes.len().min(HEADER_LEN)].to_vec() });
    }
    let peer = u16::from_be_bytes([bytes[2], bytes[3]]);
    if peer != PROTOCOL_VERSION {
        return Err(WireError::Version { peer, local: PROTOCOL_VERSION });
    }
    postcard::take_from_bytes(&bytes[HEADER_LEN..]).map_err(|e| WireError::Malformed { what, reason: e.to_string() })
}

/// A stable 64-bit FNV-1a hash of what must match for two engines to share KV: protocol
/// version, model, and the layout without its block size (block sizes are checked apart,
/// since P's may be a divisor of D's).
pub fn compatibility_hash(model: &str, layout: &KvLayout) -> u64 {
    let l = layout.with_block_tokens(0);
    let mut h = crate::Fnv1a::new();
    h.write(PROTOCOL_VERSION.to_le_bytes());
    h.write((model.len() as u64).to_le_bytes());
    h.write(model.bytes());
    for v in [l.layers, l.kv_heads, l.head_dim] {
        h.write(v.to_le_bytes());
    }
    h.write([l.dtype.index(), l.attention as u8, l.order as u8, l.placement as u8]);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::MemoryOrder;
    use proptest::prelude::*;

    fn request_id() -> impl Strategy<Value = RequestId> {
        "[ -~]{0,64}".prop_map(RequestId::new)
    }

    fn message() -> impl Strategy<Value = Message> {
        prop_oneof![
            (request_id(), any::<u32>())
                .prop_map(|(request, expected_consumers)| Message::Completion { request, expected_consumers }),
            prop::collection::vec(request_id(), 0..20).prop_map(|requests| Message::Heartbeat { requests }),
            prop::collection::vec((request_id(), prop::option::of(any::<u64>()), any::<bool>()), 0..20).prop_map(|v| {
                Message::HeartbeatAck {
                    renewals: v
                        .into_iter()
                        .map(|(request, held, released)| {
                            let lease = match (held, released) {
                                (Some(d), _) => LeaseState::Held(Time::from_nanos(d)),
                                (None, true) if request.as_str().len() % 2 == 0 => LeaseState::Released,
                                (None, true) => LeaseState::Refused,
                                (None, false) => LeaseState::Unknown,
                            };
                            Renewal { request, lease }
                        })
                        .collect(),
                }
            }),
            request_id().prop_map(|request| Message::Rejection { request }),
            request_id().prop_map(|request| Message::Abort { request }),
            (
                request_id(),
                "[a-z0-9]{1,16}",
                (any::<u32>(), any::<u32>()),
                prop::collection::vec(any::<u32>(), 0..64),
                (any::<u32>(), any::<u32>()),
                prompt()
            )
                .prop_map(
                    |(request, engine, (decode_rank, decode_tp), blocks, (first_block, prefill_pp), prompt)| {
                        Message::PushRegistration(PushRegistration {
                            export: request.clone(),
                            request,
                            decode_engine: EngineId::new(engine),
                            decode_rank,
                            decode_tp,
                            blocks: blocks.into_iter().map(BlockId).collect(),
                            first_block,
                            prefill_pp,
                            prompt,
                        })
                    }
                ),
            (request_id(), prompt(), prop::option::of(any::<[u8; 16]>())).prop_map(|(request, prompt, blocks)| {
                Message::Claim(Claim { request, prompt, blocks: blocks.map(Digest) })
            }),
        ]
    }

    fn prompt() -> impl Strategy<Value = Prompt> {
        (any::<u64>(), prop::option::of(any::<[u8; 16]>()))
            .prop_map(|(tokens, digest)| Prompt { tokens, digest: digest.map(Digest) })
    }

    proptest! {
        #[test]
        fn any_bytes_decode_to_a_value_or_an_error(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            let _ = Message::decode(&bytes);
            let _ = Handshake::decode(&bytes);
        }

        #[test]
        fn bytes_after_a_valid_header_decode_to_a_value_or_an_error(body in prop::collection::vec(any::<u8>(), 0..512)) {
            let mut frame = b"KV".to_vec();
            frame.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
            frame.extend_from_slice(&body);
            if let Ok(message) = Message::decode(&frame) {
                // Whatever decodes is a message this build can send back.
                let again = message.encode().unwrap();
                prop_assert_eq!(Message::decode(&again).unwrap(), message);
            }
            let _ = Handshake::decode(&frame);
        }

        #[test]
        fn messages_round_trip(message in message()) {
            let frame = message.encode().unwrap();
            prop_assert!(frame.len() <= MAX_MESSAGE_BYTES);
            prop_assert_eq!(Message::decode(&frame).unwrap(), message);
        }

        #[test]
        fn truncated_frames_are_errors(message in message(), cut in any::<prop::sample::Index>()) {
            let frame = message.encode().unwrap();
            let cut = cut.index(frame.len());
            prop_assert!(Message::decode(&frame[..cut]).is_err());
        }
    }

    #[test]
    fn bad_frames_name_what_is_wrong() {
        let frame = Message::Rejection { request: "r1".into() }.encode().unwrap();
        assert_eq!(
            Message::decode(b"HB:r1").unwrap_err().to_string(),
            "not a kvflow frame (starts with [48, 42, 3a, 72])"
        );
        let mut future = frame.clone();
        future[3] = 9;
        assert_eq!(Message::decode(&future).unwrap_err().to_string(), "protocol version mismatch: peer 9, local 4");
        let mut trailing = frame.clone();
        trailing.push(0);
        assert_eq!(Message::decode(&trailing).unwrap_err().to_string(), "malformed message: 1 trailing bytes");
        let huge = vec![b'K'; MAX_MESSAGE_BYTES + 1];
        assert_eq!(
            Message::decode(&huge).unwrap_err(),
            WireError::Oversized { len: MAX_MESSAGE_BYTES + 1, max: MAX_MESSAGE_BYTES }
        );
    }

    #[test]
    fn limits_hold_on_encode_too() {
        let long = RequestId::new("x".repeat(MAX_REQUEST_ID_LEN + 1));
        assert_eq!(
            Message::Abort { request: long }.encode().unwrap_err(),
            WireError::RequestIdTooLong { len: MAX_REQUEST_ID_LEN + 1, max: MAX_REQUEST_ID_LEN }
        );
        let requests = (0..2000).map(|i| RequestId::new(format!("request-{i:040}"))).collect();
        assert!(matches!(Message::Heartbeat { requests }.encode(), Err(WireError::Oversized { .. })));
    }

    #[test]
    fn handshakes_round_trip_and_hash_what_must_match() {
        let layout = KvLayout::llama3_8b(16);
        let hs = Handshake {
            protocol_version: PROTOCOL_VERSION,
            engine: EngineId::new("prefill0"),
            rank: 1,
            tp_size: 2,
            pp_size: 1,
            instance: 0,
            role: Role::Prefill,
            model: "llama".into(),
            layout,
            num_blocks: 1000,
            regions: vec![RegionBase { addr: 0x7f00_0000, len: 1 << 30 }],
            compat_hash: compatibility_hash("llama", &layout),
            clock: Time::from_millis(1234),
            agent_metadata: vec![7; 10_000],
        };
        assert_eq!(Handshake::decode(&hs.encode().unwrap()).unwrap(), hs);
        // vLLM's FlashAttention layer (placement index 2) and vLLM 0.33's packed K and V
        // (attention index 3), in either order.
        for order in [MemoryOrder::Nhd, MemoryOrder::Hnd] {
            let packed = KvLayout { attention: crate::Attention::PackedKv, order, ..layout };
            let hs = Handshake { layout: packed, compat_hash: compatibility_hash("llama", &packed), ..hs.clone() };
            assert_eq!(Handshake::decode(&hs.encode().unwrap()).unwrap(), hs);
            let flash = KvLayout { placement: crate::Placement::LayerPlaneMajor, order, ..layout };
            let hs = Handshake { layout: flash, compat_hash: compatibility_hash("llama", &flash), ..hs.clone() };
            assert_eq!(Handshake::decode(&hs.encode().unwrap()).unwrap(), hs);
            assert_ne!(
                hs.compat_hash,
                compatibility_hash("llama", &KvLayout { placement: crate::Placement::LayerMajor, ..flash })
            );
        }
        // The offer's own version must be its header's (the vectors once disagreed).
        let older = Handshake { protocol_version: 1, ..hs.clone() };
        assert_eq!(
            Handshake::decode(&older.encode().unwrap()).unwrap_err().to_string(),
            format!("malformed handshake: protocol_version 1 in a frame of version {PROTOCOL_VERSION}")
        );
        // Block size is checked apart; everything else changes the hash.
        assert_eq!(compatibility_hash("llama", &layout), compatibility_hash("llama", &layout.with_block_tokens(64)));
        assert_ne!(compatibility_hash("llama", &layout), compatibility_hash("qwen", &layout));
        assert_ne!(
            compatibility_hash("llama", &layout),
            compatibility_hash("llama", &KvLayout { order: MemoryOrder::Nhd, ..layout })
        );
        assert_ne!(
            compatibility_hash("llama", &KvLayout { dtype: crate::Dtype::Fp8E4m3, ..layout }),
            compatibility_hash("llama", &KvLayout { dtype: crate::Dtype::Fp8E5m2, ..layout }),
            "formats of one size hash apart"
        );
    }
}
