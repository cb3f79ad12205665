//! kvflow's pure domain: what a KV block transfer is, with no I/O.
//!
//! kv-core models the identifiers of disaggregated serving (requests and their
//! parallel-sampling siblings, blocks, engines, the NIXL agents of their TP ranks), the shape
//! of a KV pool, the mapping between a prefill engine's and a decode engine's TP ranks and
//! block sizes, the transfer plans that turn block ids into merged descriptor pairs, the wire
//! messages with their codec, the side channel's authenticated handshake ([`side`]), and the
//! ports ([`Clock`], [`Transport`], [`Memory`], [`discovery::Discovery`]) that adapters implement. It reads no clock, opens no socket and starts no thread: time and bytes
//! come in as arguments, which is what lets the simulator and the engines run the same code.
//!
//! ```
//! use kv_core::{TpMapping, BlockSizeMapping, BlockId};
//!
//! // D with TP 4 reads from P with TP 2: D rank 2 reads P rank 1, and each P rank
//! // waits for two completions before it frees.
//! let tp = TpMapping::new(2, 4, 8, false)?;
//! assert_eq!(tp.decode_rank(2)?.reads[0].prefill_rank, 1);
//! assert_eq!(tp.consumers_per_prefill_rank(), 2);
//!
//! // P's 4-token blocks land in D's 16-token blocks as quarters; P's 32-token blocks give
//! // each of two 16-token D blocks its half.
//! let small = BlockSizeMapping::new(4, 16)?.pieces(&[BlockId(5), BlockId(6)], 0, &[BlockId(1)])?;
//! assert_eq!(small.iter().map(|p| p.decode_token).collect::<Vec<_>>(), vec![0, 4]);
//! let large = BlockSizeMapping::new(32, 16)?.pieces(&[BlockId(5)], 0, &[BlockId(1), BlockId(2)])?;
//! assert_eq!(large.iter().map(|p| p.prefill_token).collect::<Vec<_>>(), vec![0, 16]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod agent;
pub mod blocks;
#[cfg(any(test, feature = "contract"))]
pub mod contract;
pub mod discovery;
pub mod fnv;
pub mod handshake;
pub mod id;
pub mod layout;
pub mod plan;
pub mod ports;
pub mod prompt;
pub mod side;
pub mod time;
pub mod tp;
pub mod wire;

pub use blocks::{blocks_for_tokens, BlockSizeError, BlockSizeMapping, Piece, PrefillSpan};
pub use fnv::Fnv1a;
pub use handshake::{check_compatible, Compatible, HandshakeError};
pub use id::{AgentName, BlockId, EngineId, RequestId};
pub use layout::{Attention, Dtype, KvLayout, LayerRange, LayoutError, MemoryOrder, Placement, PoolShape};
pub use plan::{DescriptorPair, Granularity, Initiator, PlanError, PlanInput, PoolSide, RegionBase, TransferPlan};
pub use ports::{
    Clock, CutOffReason, Descriptors, Memory, MemoryError, MemoryKind, Notification, PeerAddress, PeerEvent, PeerInfo,
    PollIntervals, PreparedId, PreparedLists, PreparedTransfer, RefusalCause, Region, RegionId, TransferId, TransferOp,
    TransferRequest, TransferSizes, TransferStatus, Transport, TransportError,
};
pub use prompt::{Digest, Prompt, PromptMismatch};
pub use time::Time;
pub use tp::{DecodeRankPlan, HeadSlice, TpError, TpMapping};
pub use wire::{Claim, Handshake, LeaseState, Message, PushRegistration, Renewal, Role, WireError};
