//! The handshake check: what two engines must agree on before any block moves.
//!
//! Both sides run [`check_compatible`] on the pair of [`Handshake`]s; a refusal names both
//! sides' values, so that a misconfigured deployment says what to fix.

use crate::blocks::{BlockSizeError, BlockSizeMapping};
use crate::tp::{TpError, TpMapping};
use crate::wire::{compatibility_hash, Handshake, Role};

/// Why two engines cannot exchange KV.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum HandshakeError {
    /// The protocol versions differ.
    #[error("protocol version mismatch: prefill {prefill}, decode {decode}")]
    Version {
        /// P's version.
        prefill: u16,
        /// D's version.
        decode: u16,
    },
    /// Both sides claim the same role.
    #[error("role mismatch: both sides are {role:?}")]
    Role {
        /// The shared role.
        role: Role,
    },
    /// The models differ.
    #[error("model mismatch: prefill {prefill:?}, decode {decode:?}")]
    Model {
        /// P's model.
        prefill: String,
        /// D's model.
        decode: String,
    },
    /// A layout field differs.
    #[error("kv layout mismatch in {field}: prefill {prefill}, decode {decode}")]
    Layout {
        /// The field.
        field: &'static str,
        /// P's value.
        prefill: String,
        /// D's value.
        decode: String,
    },
    /// A side's hash does not match what its own model and layout hash to.
    #[error("compatibility hash mismatch: prefill {prefill:#018x}, decode {decode:#018x}")]
    Hash {
        /// P's hash.
        prefill: u64,
        /// D's hash.
        decode: u64,
    },
    /// The block sizes do not pair.
    #[error(transparent)]
    BlockSize(#[from] BlockSizeError),
    /// The TP sizes do not map.
    #[error(transparent)]
    Tp(#[from] TpError),
    /// A rank is not below its engine's worker count (TP size times pipeline stages).
    #[error("{side} rank {rank} is out of range for tp {tp} x pp {pp}")]
    Rank {
        /// `"prefill"` or `"decode"`.
        side: &'static str,
        /// The rank.
        rank: u32,
        /// The TP size.
        tp: u32,
        /// The pipeline-parallel size.
        pp: u32,
    },
    /// P's pipeline stages do not split the model's layers evenly.
    #[error("prefill pipeline-parallel size {pp} does not split {layers} layers evenly")]
    PrefillStages {
        /// P's pipeline-parallel size.
        pp: u32,
        /// The model's layers.
        layers: u32,
    },
    /// D runs pipeline stages; kvflow's decode engines hold every layer on each rank.
    #[error("decode pipeline-parallel size {pp}: a decode engine must hold every layer (pp 1)")]
    DecodeStages {
        /// D's pipeline-parallel size.
        pp: u32,
    },
}

/// What a successful handshake fixes for the pair of engines.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Compatible {
    /// The TP mapping.
    pub tp: TpMapping,
    /// The block-size mapping.
    pub blocks: BlockSizeMapping,
}

/// Checks that `local` and `peer` can exchange KV; both sides call it, and get the same answer.
pub fn check_compatible(local: &Handshake, peer: &Handshake) -> Result<Compatible, HandshakeError> {
    let (p, d) = match (local.role, peer.role) {
        (Role::Prefill, Role::Decode) => (local, peer),
        (Role::Decode, Role::Prefill) => (peer, local),
        (role, _) => return Err(HandshakeError::Role { role }),
    };
    if p.protocol_version != d.protocol_version {
        return Err(HandshakeError::Version { prefill: p.protocol_version, decode: d.protocol_version });
    }
    if p.model != d.model {
        return Err(HandshakeError::Model { prefill: p.model.clone(), decode: d.model.clone() });
    }
    let (pl, dl) = (&p.layout, &d.layout);
    let fields: [(&'static str, String, String); 7] = [
        ("layers", pl.layers.to_string(), dl.layers.to_string()),
        ("kv_heads", pl.kv_heads.to_string(), dl.kv_heads.to_string()),
        ("head_dim", pl.head_dim.to_string(), dl.head_dim.to_string()),
        ("dtype", pl.dtype.to_string(), dl.dtype.to_string()),
        ("attention", format!("{:?}", pl.attention), format!("{:?}", dl.attention)),
        ("order", format!("{:?}", pl.order), format!("{:?}", dl.order)),
        ("placement", format!("{:?}", pl.placement), format!("{:?}", dl.placement)),
    ];
    if let Some((field, prefill, decode)) = fields.into_iter().find(|(_, a, b)| a != b) {
        return Err(HandshakeError::Layout { field, prefill, decode });
    }
    if p.compat_hash != d.compat_hash || p.compat_hash != compatibility_hash(&p.model, pl) {
        return Err(HandshakeError::Hash { prefill: p.compat_hash, decode: d.compat_hash });
    }
    let blocks = BlockSizeMapping::for_layout(pl, dl.block_tokens)?;
    let tp = TpMapping::new(p.tp_size, d.tp_size, pl.kv_heads, pl.is_mla())?;
    if p.pp_size == 0 || pl.layers % p.pp_size != 0 {
        return Err(HandshakeError::PrefillStages { pp: p.pp_size, layers: pl.layers });
    }
    if d.pp_size != 1 {
        return Err(HandshakeError::DecodeStages { pp: d.pp_size });
    }
    for (side, hs) in [("prefill", p), ("decode", d)] {
        if hs.rank >= hs.workers() {
            return Err(HandshakeError::Rank { side, rank: hs.rank, tp: hs.tp_size, pp: hs.pp_size });
        }
    }
    Ok(Compatible { tp, blocks })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::id::EngineId;
    use crate::layout::{Dtype, KvLayout, MemoryOrder};
    use crate::time::Time;
    use crate::wire::PROTOCOL_VERSION;

    fn offer(role: Role, tp_size: u32, block_tokens: u32) -> Handshake {
        let layout = KvLayout::split_kv(4, block_tokens, 8, 64, crate::Dtype::Bfloat16);
        Handshake {
            protocol_version: PROTOCOL_VERSION,
            engine: EngineId::new(format!("{role:?}")),
            rank: 0,
            tp_size,
            pp_size: 1,
            instance: 0,
            role,
            model: "m".into(),
            layout,
            num_blocks: 10,
            regions: Vec::new(),
            compat_hash: compatibility_hash("m", &layout),
            clock: Time::ZERO,
            agent_metadata: Vec::new(),
        }
    }

    fn refusal(p: &Handshake, d: &Handshake) -> String {
        let a = check_compatible(p, d).unwrap_err();
        let b = check_compatible(d, p).unwrap_err();
        assert_eq!(a, b, "both sides give the same answer");
        a.to_string()
    }

    #[test]
    fn compatible_pairs_give_the_mappings() {
        let ok = check_compatible(&offer(Role::Decode, 4, 32), &offer(Role::Prefill, 2, 16)).unwrap();
        assert_eq!(ok.tp.consumers_per_prefill_rank(), 2);
        assert_eq!((ok.blocks.prefill_tokens(), ok.blocks.decode_tokens()), (16, 32));
        // P's blocks may be the larger, as vLLM maps them.
        let larger = check_compatible(&offer(Role::Prefill, 2, 32), &offer(Role::Decode, 2, 16)).unwrap();
        assert_eq!(larger.blocks.piece_tokens(), 16);
    }

    #[test]
    fn mismatches_name_both_values() {
        let (p, d) = (offer(Role::Prefill, 2, 16), offer(Role::Decode, 2, 16));
        assert_eq!(
            refusal(&p, &offer(Role::Decode, 2, 24)),
            "block size mismatch: neither the prefill block of 16 tokens nor the decode block of 24 tokens is a multiple of the other"
        );
        assert_eq!(
            refusal(&p, &offer(Role::Decode, 3, 16)),
            "tensor-parallel sizes do not divide: prefill 2, decode 3"
        );
        let mut next = d.clone();
        next.protocol_version = PROTOCOL_VERSION + 1;
        assert_eq!(
            refusal(&p, &next),
            format!("protocol version mismatch: prefill {PROTOCOL_VERSION}, decode {}", PROTOCOL_VERSION + 1)
        );
        let mut nhd = d.clone();
        nhd.layout.order = MemoryOrder::Nhd;
        nhd.compat_hash = compatibility_hash("m", &nhd.layout);
        assert_eq!(refusal(&p, &nhd), "kv layout mismatch in order: prefill Hnd, decode Nhd");
        let mut other = d.clone();
        other.model = "n".into();
        assert_eq!(refusal(&p, &other), "model mismatch: prefill \"m\", decode \"n\"");
        let mut forged = d.clone();
        forged.compat_hash ^= 1;
        assert!(refusal(&p, &forged).starts_with("compatibility hash mismatch: prefill 0x"));
        assert_eq!(refusal(&p, &p.clone()), "role mismatch: both sides are Prefill");
        let mut rank = d.clone();
        rank.rank = 2;
        assert_eq!(refusal(&p, &rank), "decode rank 2 is out of range for tp 2 x pp 1");
    }

    #[test]
    fn fused_kv_splits_heads_across_ranks_but_moves_blocks_only_whole() {
        let fused = |role, tp, block| {
            let mut o = offer(role, tp, block);
            o.layout.attention = crate::Attention::FusedKv;
            o.compat_hash = compatibility_hash("m", &o.layout);
            o
        };
        let ok = check_compatible(&fused(Role::Prefill, 2, 16), &fused(Role::Decode, 1, 16)).unwrap();
        assert_eq!(ok.tp.consumers_per_prefill_rank(), 1);
        assert_eq!(
            refusal(&fused(Role::Prefill, 1, 32), &fused(Role::Decode, 1, 16)),
            "block size mismatch: a FusedKv layout moves whole blocks only, and the prefill block holds 32 tokens, the decode block 16"
        );
        assert_eq!(
            refusal(&fused(Role::Prefill, 1, 16), &offer(Role::Decode, 1, 16)),
            "kv layout mismatch in attention: prefill FusedKv, decode SplitKv"
        );
    }

    #[test]
    fn element_formats_of_one_size_are_told_apart() {
        // fp8's two formats are both one byte: wire protocol 2 compared only the size.
        let with = |role, dtype| {
            let mut o = offer(role, 2, 16);
            o.layout.dtype = dtype;
            o.compat_hash = compatibility_hash("m", &o.layout);
            o
        };
        let (p, d) = (with(Role::Prefill, Dtype::Fp8E4m3), with(Role::Decode, Dtype::Fp8E5m2));
        assert_eq!(refusal(&p, &d), "kv layout mismatch in dtype: prefill fp8_e4m3, decode fp8_e5m2");
        let (p, d) = (with(Role::Prefill, Dtype::Float16), with(Role::Decode, Dtype::Bfloat16));
        assert_eq!(refusal(&p, &d), "kv layout mismatch in dtype: prefill float16, decode bfloat16");
        assert!(check_compatible(&with(Role::Prefill, Dtype::Fp8E5m2), &with(Role::Decode, Dtype::Fp8E5m2)).is_ok());
        // A peer that forges its hash to hide the difference is refused by the hash.
        let mut forged = with(Role::Decode, Dtype::Fp8E5m2);
        forged.compat_hash = compatibility_hash("m", &with(Role::Decode, Dtype::Fp8E4m3).layout);
        assert!(compatibility_hash("m", &forged.layout) != forged.compat_hash);
    }

    #[test]
    fn prefill_stages_split_the_layers_and_decode_has_one() {
        let (mut p, d) = (offer(Role::Prefill, 2, 16), offer(Role::Decode, 2, 16));
        p.pp_size = 2;
        p.rank = 3; // stage 1, TP rank 1
        assert_eq!((p.pp_rank(), p.tp_rank(), p.workers()), (1, 1, 4));
        assert!(check_compatible(&p, &d).is_ok());
        p.rank = 4;
        assert_eq!(refusal(&p, &d), "prefill rank 4 is out of range for tp 2 x pp 2");
        p.pp_size = 3;
        assert_eq!(refusal(&p, &d), "prefill pipeline-parallel size 3 does not split 4 layers evenly");
        let mut staged = d.clone();
        staged.pp_size = 2;
        assert_eq!(
            refusal(&offer(Role::Prefill, 2, 16), &staged),
            "decode pipeline-parallel size 2: a decode engine must hold every layer (pp 1)"
        );
    }
}
