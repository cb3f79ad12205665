//! Transfer plans: from block ids to the descriptor pairs a transport posts.
//!
//! A plan pairs P's blocks with D's in pieces of the smaller block size, takes the head slice that the TP mapping
//! gives, and emits `(local, remote, len)` byte ranges from the initiator's point of view (D
//! reads in pull mode, P writes in push mode). Ranges that are contiguous on both sides, in
//! the same regions, are merged as they are emitted: a run of adjacent blocks with whole heads
//! becomes one descriptor, which is where most of the data path's speed comes from.

use crate::blocks::{BlockSizeError, BlockSizeMapping, Piece};
use crate::id::BlockId;
use crate::layout::{KvLayout, LayerRange, MemoryOrder, Placement, PoolShape};
use crate::tp::HeadSlice;

/// A registered region of a pool: its base address and length.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, serde::Serialize, serde::Deserialize)]
pub struct RegionBase {
    /// Address of the first byte.
    pub addr: u64,
    /// Bytes in the region.
    pub len: u64,
}

/// One side of a transfer: a rank's pool, its regions, and the blocks of this request.
#[derive(Clone, Copy, Debug)]
pub struct PoolSide<'a> {
    /// The rank's pool shape.
    pub shape: PoolShape,
    /// The pool's regions, as many as `shape.region_count()`.
    pub regions: &'a [RegionBase],
    /// The request's blocks in this pool, in prompt order.
    pub blocks: &'a [BlockId],
}

/// Who posts the transfer; the plan's `local` side is theirs.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Initiator {
    /// Pull mode: D reads from P.
    Decode,
    /// Push mode: P writes into D.
    Prefill,
}

/// How far descriptors are merged.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Granularity {
    /// Merge every range contiguous on both sides.
    Merged,
    /// Merge only within one P block: one descriptor per block at best, as production
    /// connectors post them (the baseline the benches compare against).
    PerBlock,
}

/// One descriptor pair: `len` bytes from `local_addr` to or from `remote_addr`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct DescriptorPair {
    /// Index of the initiator's region.
    pub local_region: u32,
    /// Initiator's address.
    pub local_addr: u64,
    /// Index of the peer's region.
    pub remote_region: u32,
    /// Peer's address.
    pub remote_addr: u64,
    /// Bytes.
    pub len: u64,
}

/// Why a plan cannot be built; every variant names the values that disagree.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum PlanError {
    /// P's and D's layouts differ in more than block size.
    #[error("kv layout mismatch: prefill {prefill:?}, decode {decode:?}")]
    LayoutMismatch {
        /// P's layout.
        prefill: Box<KvLayout>,
        /// D's layout.
        decode: Box<KvLayout>,
    },
    /// The block sizes do not pair, or D has too few blocks.
    #[error(transparent)]
    BlockSize(#[from] BlockSizeError),
    /// A side lists a different number of regions than its layout has.
    #[error("{side} pool has {got} regions, its layout has {expected}")]
    RegionCount {
        /// `"prefill"` or `"decode"`.
        side: &'static str,
        /// Regions given.
        got: usize,
        /// Regions the layout has.
        expected: u32,
    },
    /// A region is smaller than the pool its layout describes.
    #[error("{side} region {region} is {len} bytes, its pool needs {needed}")]
    RegionTooSmall {
        /// `"prefill"` or `"decode"`.
        side: &'static str,
        /// Region index.
        region: u32,
        /// Its length.
        len: u64,
        /// Bytes the layout needs.
        needed: u64,
    },
    /// A block id is not in the pool.
    #[error("{side} block {block} is outside its pool of {num_blocks} blocks")]
    BlockOutOfPool {
        /// `"prefill"` or `"decode"`.
        side: &'static str,
        /// The block.
        block: BlockId,
        /// Blocks in the pool.
        num_blocks: u32,
    },
    /// The head slice does not fit one side's heads.
    #[error("head slice {first}..{end} does not fit the {side} rank's {heads} heads")]
    HeadSliceOutOfRange {
        /// `"prefill"` or `"decode"`.
        side: &'static str,
        /// First head of the slice on that side.
        first: u32,
        /// One past its last head.
        end: u64,
        /// Heads that side holds.
        heads: u32,
    },
    /// P has no blocks to move.
    #[error("no prefill blocks to transfer")]
    Empty,
    /// The two pools hold no layer in common (pipeline stages that do not meet).
    #[error("prefill layers {}..{} and decode layers {}..{} do not overlap", prefill.first, prefill.end(), decode.first, decode.end())]
    NoCommonLayers {
        /// P's layers.
        prefill: LayerRange,
        /// D's layers.
        decode: LayerRange,
    },
    /// A plan of some layers asked for none that both pools hold.
    #[error("layers {}..{} are none of the layers {}..{} both pools hold", asked.start, asked.end, held.start, held.end)]
    LayersNotHeld {
        /// The layers asked for, as the model numbers them.
        asked: std::ops::Range<u32>,
        /// The layers both pools hold.
        held: std::ops::Range<u32>,
    },
}

/// The descriptor pairs of one transfer between one D rank and one P rank.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub struct TransferPlan {
    pairs: Vec<DescriptorPair>,
    bytes: u64,
}

/// Everything a plan is built from.
#[derive(Clone, Copy, Debug)]
pub struct PlanInput<'a> {
    /// P's rank: pool, regions, the export's blocks.
    pub prefill: PoolSide<'a>,
    /// D's rank: pool, regions, the blocks D allocated.
    pub decode: PoolSide<'a>,
    /// Tokens of P's first block that are not moved: when P's blocks are larger than D's and
    /// D's cache already holds the prompt's first D blocks, the read starts inside a P block
    /// (see [`BlockSizeMapping::prefill_span`]). Otherwise 0.
    pub skip_tokens: u32,
    /// The heads moved, from the TP mapping.
    pub slice: HeadSlice,
    /// Who posts the transfer.
    pub initiator: Initiator,
}

impl TransferPlan {
    /// Builds the plan, merging as far as `granularity` allows.
    pub fn build(input: &PlanInput<'_>, granularity: Granularity) -> Result<Self, PlanError> {
        Self::build_layers(input, granularity, 0..u32::MAX)
    }

    /// As [`TransferPlan::build`], moving only the model layers in `only` of those both pools
    /// hold: what a prefill engine that computes layer by layer can write of a chunk once some
    /// of its layers are done. The plans of ranges that split the layers move, together, the
    /// bytes of the whole plan.
    pub fn build_layers(
        input: &PlanInput<'_>,
        granularity: Granularity,
        only: std::ops::Range<u32>,
    ) -> Result<Self, PlanError> {
        let (p, d, slice) = (&input.prefill, &input.decode, input.slice);
        if p.shape.layout.with_block_tokens(0) != d.shape.layout.with_block_tokens(0) {
            return Err(PlanError::LayoutMismatch {
                prefill: Box::new(p.shape.layout),
                decode: Box::new(d.shape.layout),
            });
        }
        if p.blocks.is_empty() {
            return Err(PlanError::Empty);
        }
        let mapping = BlockSizeMapping::for_layout(&p.shape.layout, d.shape.layout.block_tokens)?;
        for (side, pool) in [("prefill", p), ("decode", d)] {
            check_side(side, pool)?;
        }
        for (side, first, heads) in
            [("prefill", slice.prefill_head, p.shape.heads), ("decode", slice.decode_head, d.shape.heads)]
        {
            let end = u64::from(first) + u64::from(slice.heads);
            if slice.heads == 0 || end > u64::from(heads) {
                return Err(PlanError::HeadSliceOutOfRange { side, first, end, heads });
            }
        }
        let pieces = mapping.pieces(p.blocks, input.skip_tokens, d.blocks)?;
        // A pipeline stage moves its own layers: those both pools hold.
        let held = p.shape.layers.common(&d.shape.layers);
        if held.is_empty() {
            return Err(PlanError::NoCommonLayers { prefill: p.shape.layers, decode: d.shape.layers });
        }
        let layers = held.start.max(only.start)..held.end.min(only.end);
        if layers.is_empty() {
            return Err(PlanError::LayersNotHeld { asked: only, held });
        }

        let layout = p.shape.layout;
        let head_bytes = p.shape.head_bytes_per_token();
        let p_tokens = u64::from(layout.block_tokens);
        let d_tokens = u64::from(d.shape.layout.block_tokens);
        let piece_tokens = u64::from(mapping.piece_tokens());
        let (p_heads, d_heads) = (u64::from(p.shape.heads), u64::from(d.shape.heads));
        let (p_head0, d_head0) = (u64::from(slice.prefill_head), u64::from(slice.decode_head));
        let heads = u64::from(slice.heads);

        let mut plan = TransferPlan::default();
        let mut last_group = usize::MAX;
        // One (piece, layer) of the planes given: every head of the slice. The group is the P
        // block's position in the prompt, which bounds merging at per-block granularity.
        let mut emit_piece_layer = |piece: &Piece, layer: u32, planes: std::ops::Range<u32>| {
            let group = piece.prefill_index;
            let (p_token0, d_token0) = (u64::from(piece.prefill_token), u64::from(piece.decode_token));
            for plane in planes {
                let po = p.shape.plane_offset(layer, piece.prefill_block.0, plane);
                let dof = d.shape.plane_offset(layer, piece.decode_block.0, plane);
                let mut emit = |p_off: u64, d_off: u64, len: u64| {
                    let prefill = (po.region, p.regions[po.region as usize].addr + po.offset + p_off);
                    let decode = (dof.region, d.regions[dof.region as usize].addr + dof.offset + d_off);
                    let (local, remote) = match input.initiator {
                        Initiator::Decode => (decode, prefill),
                        Initiator::Prefill => (prefill, decode),
                    };
                    let mergeable = granularity == Granularity::Merged || group == last_group;
                    plan.push(local, remote, len, mergeable);
                    last_group = group;
                };
                match layout.order {
                    MemoryOrder::Hnd => {
                        for h in 0..heads {
                            emit(
                                ((p_head0 + h) * p_tokens + p_token0) * head_bytes,
                                ((d_head0 + h) * d_tokens + d_token0) * head_bytes,
                                piece_tokens * head_bytes,
                            );
                        }
                    }
                    MemoryOrder::Nhd => {
                        for t in 0..piece_tokens {
                            emit(
                                ((p_token0 + t) * p_heads + p_head0) * head_bytes,
                                ((d_token0 + t) * d_heads + d_head0) * head_bytes,
                                heads * head_bytes,
                            );
                        }
                    }
                }
            }
        };
        // Emit in memory order, so that adjacent ranges meet and merge.
        match layout.placement {
            Placement::BlockMajor => {
                for piece in &pieces {
                    for layer in layers.clone() {
                        emit_piece_layer(piece, layer, 0..layout.planes());
                    }
                }
            }
            Placement::LayerMajor => {
                for layer in layers {
                    for piece in &pieces {
                        emit_piece_layer(piece, layer, 0..layout.planes());
                    }
                }
            }
            Placement::LayerPlaneMajor => {
                for layer in layers {
                    for plane in 0..layout.planes() {
                        for piece in &pieces {
                            emit_piece_layer(piece, layer, plane..plane + 1);
                        }
                    }
                }
            }
        }
        Ok(plan)
    }

    fn push(&mut self, local: (u32, u64), remote: (u32, u64), len: u64, mergeable: bool) {
        self.bytes += len;
        if mergeable {
            if let Some(last) = self.pairs.last_mut() {
                if last.local_region == local.0
                    && last.remote_region == remote.0
                    && last.local_addr + last.len == local.1
                    && last.remote_addr + last.len == remote.1
                {
                    last.len += len;
                    return;
                }
            }
        }
        self.pairs.push(DescriptorPair {
            local_region: local.0,
            local_addr: local.1,
            remote_region: remote.0,
            remote_addr: remote.1,
            len,
        });
    }

    /// The descriptor pairs, in memory order (block-major pools: by block, then layer;
    /// layer-major pools: by layer, then block; layer-plane-major pools: by layer, plane,
    /// then block).
    pub fn pairs(&self) -> &[DescriptorPair] {
        &self.pairs
    }

    /// Bytes the plan moves.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Descriptors in the plan.
    pub fn len(&self) -> usize {
        self.pairs.len()
    }

    /// Whether the plan moves nothing.
    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }
}

fn check_side(side: &'static str, pool: &PoolSide<'_>) -> Result<(), PlanError> {
    let expected = pool.shape.region_count();
    if pool.regions.len() != expected as usize {
        return Err(PlanError::RegionCount { side, got: pool.regions.len(), expected });
    }
    let needed = pool.shape.region_len();
    for (region, base) in pool.regions.iter().enumerate() {
        if base.len < needed || base.addr.checked_add(base.len).is_none() {
            return Err(PlanError::RegionTooSmall { side, region: region as u32, len: base.len, needed });
        }
    }
    let num_blocks = pool.shape.num_blocks;
    match pool.blocks.iter().find(|b| b.0 >= num_blocks) {
        Some(&block) => Err(PlanError::BlockOutOfPool { side, block, num_blocks }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::tests::llama_like;
    use crate::layout::Attention;
    use crate::tp::TpMapping;

    fn ids(blocks: &[u32]) -> Vec<BlockId> {
        blocks.iter().map(|&b| BlockId(b)).collect()
    }

    fn regions(shape: &PoolShape, base: u64) -> Vec<RegionBase> {
        (0..shape.region_count() as u64)
            .map(|i| RegionBase { addr: base + i * (shape.region_len() + 4096), len: shape.region_len() })
            .collect()
    }

    fn full_slice(heads: u32) -> HeadSlice {
        HeadSlice { prefill_rank: 0, prefill_head: 0, decode_head: 0, heads }
    }

    fn plan(layout: KvLayout, p_blocks: &[u32], d_blocks: &[u32], granularity: Granularity) -> TransferPlan {
        let shape = PoolShape::new(layout, layout.kv_heads, 64).unwrap();
        let (p_regions, d_regions) = (regions(&shape, 1 << 40), regions(&shape, 1 << 20));
        let (p_ids, d_ids) = (ids(p_blocks), ids(d_blocks));
        let input = PlanInput {
            prefill: PoolSide { shape, regions: &p_regions, blocks: &p_ids },
            decode: PoolSide { shape, regions: &d_regions, blocks: &d_ids },
            skip_tokens: 0,
            slice: full_slice(layout.kv_heads),
            initiator: Initiator::Decode,
        };
        TransferPlan::build(&input, granularity).unwrap()
    }

    #[test]
    fn a_contiguous_run_is_one_descriptor_and_a_fragmented_one_is_not() {
        let layout = llama_like(Placement::BlockMajor);
        let block = PoolShape::new(layout, 8, 64).unwrap().block_bytes();

        let run = plan(layout, &[3, 4, 5, 6], &[10, 11, 12, 13], Granularity::Merged);
        assert_eq!(run.len(), 1);
        assert_eq!(run.pairs()[0].len, 4 * block);
        assert_eq!(run.pairs()[0].local_addr, (1 << 20) + 10 * block, "D is local when D reads");
        assert_eq!(run.pairs()[0].remote_addr, (1 << 40) + 3 * block);

        let fragmented = plan(layout, &[3, 4, 5, 6], &[10, 12, 14, 16], Granularity::Merged);
        assert_eq!(fragmented.len(), 4);
        assert!(fragmented.pairs().iter().all(|p| p.len == block));
        // Contiguous on one side only does not merge either.
        assert_eq!(plan(layout, &[3, 5, 7, 9], &[10, 11, 12, 13], Granularity::Merged).len(), 4);
        // Two runs make two descriptors.
        assert_eq!(plan(layout, &[0, 1, 2, 3], &[0, 1, 7, 8], Granularity::Merged).len(), 2);

        // Per-block granularity is the production baseline: one descriptor per block.
        let per_block = plan(layout, &[3, 4, 5, 6], &[10, 11, 12, 13], Granularity::PerBlock);
        assert_eq!(per_block.len(), 4);
        assert_eq!(per_block.bytes(), run.bytes());

        // Layer-major pools merge a run within each layer's region.
        let layered = plan(llama_like(Placement::LayerMajor), &[3, 4, 5, 6], &[10, 11, 12, 13], Granularity::Merged);
        assert_eq!(layered.len(), 32);
        assert_eq!(layered.bytes(), 4 * block);
        assert!(layered.pairs().iter().enumerate().all(|(i, p)| p.local_region == i as u32));
    }

    /// Fills P's pool with a value per (layer, plane, model head, prompt token, element),
    /// applies the plan as a copy, and checks every byte of D's pool.
    /// P runs `p_pp` pipeline stages, each a pool of its own layers that D reads; D's cache
    /// already holds the prompt's first `cached` D blocks, so only the rest is read.
    fn check_bytes(
        layout: KvLayout,
        (p_tp, p_pp): (u32, u32),
        d_tp: u32,
        (p_tokens, d_tokens): (u32, u32),
        prompt_tokens: u64,
        cached: usize,
    ) {
        let mapping = TpMapping::new(p_tp, d_tp, layout.kv_heads, layout.attention == Attention::Mla).unwrap();
        let sizes = BlockSizeMapping::new(p_tokens, d_tokens).unwrap();
        let p_model = PoolShape::new(layout.with_block_tokens(p_tokens), mapping.prefill_heads(), 16).unwrap();
        let d_shape = PoolShape::new(layout.with_block_tokens(d_tokens), mapping.decode_heads(), 16).unwrap();
        let (p_count, d_count) = (prompt_tokens.div_ceil(p_tokens.into()), prompt_tokens.div_ceil(d_tokens.into()));
        let p_blocks = ids(&(0..p_count as u32).map(|i| 15 - 2 * i).collect::<Vec<_>>());
        let d_blocks = ids(&(0..d_count as u32).map(|i| 2 + i).collect::<Vec<_>>());
        let span = sizes.prefill_span(cached..d_count as usize);
        let p_read = &p_blocks[span.blocks.start..span.blocks.end.min(p_blocks.len())];
        let what = format!(
            "{layout:?} p_tp {p_tp} p_pp {p_pp} d_tp {d_tp} blocks {p_tokens}/{d_tokens} prompt {prompt_tokens} cached {cached}"
        );
        let elem = |layer: u32, plane: u32, head: u64, token: u64, e: u64| -> u8 {
            // Never 0, so an untouched byte of D's pool never looks copied.
            (1 + (u64::from(layer) * 7 + u64::from(plane) * 13 + head * 31 + token * 17 + e * 3) % 251) as u8
        };
        let d_regions = regions(&d_shape, 0);
        for d_rank in 0..d_tp {
            let rank_plan = mapping.decode_rank(d_rank).unwrap();
            let mut d_mem = vec![vec![0u8; d_shape.region_len() as usize + 4096]; d_regions.len()];
            let mut d_by_layers = d_mem.clone();
            for (stage, slice) in (0..p_pp).flat_map(|stage| rank_plan.reads.iter().map(move |slice| (stage, slice))) {
                let p_shape = p_model.for_stage(stage, p_pp).unwrap();
                let p_regions = regions(&p_shape, 0);
                // P rank's memory: its heads are model heads starting at its first head.
                let p_first =
                    if layout.attention == Attention::Mla { 0 } else { slice.prefill_rank * mapping.prefill_heads() };
                let p_mem = fill_pool(&p_shape, &p_blocks, |layer, plane, h, tok, e| {
                    elem(layer, plane, u64::from(p_first + h), tok, e)
                });
                let input = PlanInput {
                    prefill: PoolSide { shape: p_shape, regions: &p_regions, blocks: p_read },
                    decode: PoolSide { shape: d_shape, regions: &d_regions, blocks: &d_blocks[cached..] },
                    skip_tokens: span.skip_tokens,
                    slice: *slice,
                    initiator: Initiator::Decode,
                };
                let plan = TransferPlan::build(&input, Granularity::Merged).unwrap();
                // Also as a prefill engine computing layer by layer writes it: the stage's
                // first layer, then the rest, into a pool of its own.
                let held = p_shape.layers.first..p_shape.layers.end();
                let first = TransferPlan::build_layers(&input, Granularity::Merged, held.start..held.start + 1);
                let rest = TransferPlan::build_layers(&input, Granularity::Merged, held.start + 1..u32::MAX);
                // A stage of one layer has no rest to write.
                let rest = match rest {
                    Err(PlanError::LayersNotHeld { .. }) if held.len() == 1 => TransferPlan::default(),
                    rest => rest.unwrap(),
                };
                let halves = [first.unwrap(), rest];
                assert_eq!(halves[0].bytes() + halves[1].bytes(), plan.bytes(), "{what}");
                let apply = |plan: &TransferPlan, d_mem: &mut Vec<Vec<u8>>| {
                    for pair in plan.pairs() {
                        let (la, ra, len) = (pair.local_addr as usize, pair.remote_addr as usize, pair.len as usize);
                        let lbase = d_regions[pair.local_region as usize].addr as usize;
                        let rbase = p_regions[pair.remote_region as usize].addr as usize;
                        d_mem[pair.local_region as usize][la - lbase..la - lbase + len]
                            .copy_from_slice(&p_mem[pair.remote_region as usize][ra - rbase..ra - rbase + len]);
                    }
                };
                apply(&plan, &mut d_mem);
                halves.iter().for_each(|half| apply(half, &mut d_by_layers));
            }
            // Expected: D's heads are the model heads it owns, for the tokens both sides hold
            // past D's cached blocks (P's last block is read whole, past the prompt).
            let d_first = if layout.attention == Attention::Mla {
                0
            } else if d_tp <= layout.kv_heads {
                d_rank * mapping.decode_heads()
            } else {
                d_rank / (d_tp / layout.kv_heads)
            };
            let read = cached as u64 * u64::from(d_tokens)..p_count * u64::from(p_tokens);
            let expected = fill_pool(&d_shape, &d_blocks, |layer, plane, h, tok, e| {
                if read.contains(&tok) {
                    elem(layer, plane, u64::from(d_first + h), tok, e)
                } else {
                    0
                }
            });
            for (mem, how) in [(&d_mem, "whole"), (&d_by_layers, "layer by layer")] {
                let got: Vec<Vec<u8>> = mem.iter().map(|m| m[..d_shape.region_len() as usize].to_vec()).collect();
                assert!(expected == got, "{what} d_rank {d_rank}, {how}");
            }
        }
    }

    /// A pool whose `blocks` (in prompt order) hold `value(layer, plane, head, prompt token, byte)`.
    fn fill_pool(shape: &PoolShape, blocks: &[BlockId], value: impl Fn(u32, u32, u32, u64, u64) -> u8) -> Vec<Vec<u8>> {
        let mut mem = vec![vec![0u8; shape.region_len() as usize]; shape.region_count() as usize];
        let l = shape.layout;
        let hb = shape.head_bytes_per_token();
        for (i, block) in blocks.iter().enumerate() {
            for layer in shape.layers.first..shape.layers.end() {
                for plane in 0..l.planes() {
                    let at = shape.plane_offset(layer, block.0, plane);
                    for h in 0..shape.heads {
                        for t in 0..u64::from(l.block_tokens) {
                            let token = i as u64 * u64::from(l.block_tokens) + t;
                            let within = match l.order {
                                MemoryOrder::Hnd => (u64::from(h) * u64::from(l.block_tokens) + t) * hb,
                                MemoryOrder::Nhd => (t * u64::from(shape.heads) + u64::from(h)) * hb,
                            };
                            for e in 0..hb {
                                mem[at.region as usize][(at.offset + within + e) as usize] =
                                    value(layer, plane, h, token, e);
                            }
                        }
                    }
                }
            }
        }
        mem
    }

    #[test]
    fn plans_move_the_right_bytes() {
        let small = |order, placement, attention| KvLayout {
            layers: 2,
            block_tokens: 4,
            kv_heads: 4,
            head_dim: 2,
            dtype: crate::Dtype::Bfloat16,
            attention,
            order,
            placement,
        };
        for order in [MemoryOrder::Hnd, MemoryOrder::Nhd] {
            for placement in [Placement::BlockMajor, Placement::LayerMajor, Placement::LayerPlaneMajor] {
                let layout = small(order, placement, Attention::SplitKv);
                for (p_tp, d_tp) in [(1, 1), (2, 2), (1, 2), (2, 4), (2, 1), (4, 2), (4, 1), (2, 8)] {
                    // Equal, P smaller, P larger; prompts that end inside a block of either side;
                    // partial prefix hits that start inside a larger P block.
                    for (sizes, prompt, cached) in [
                        ((4, 4), 12, 0),
                        ((2, 8), 10, 0),
                        ((4, 8), 16, 1),
                        ((8, 4), 13, 0),
                        ((8, 2), 22, 3),
                        ((8, 4), 20, 1),
                        ((8, 4), 20, 2),
                    ] {
                        for p_pp in [1, 2] {
                            check_bytes(layout, (p_tp, p_pp), d_tp, sizes, prompt, cached);
                        }
                    }
                }
                if order == MemoryOrder::Hnd {
                    // Each head's K and V together (vLLM's CPU attention): heads split across
                    // ranks, blocks of one size moved whole, a partial prefix hit included.
                    let fused = small(order, placement, Attention::FusedKv);
                    for (p_tp, d_tp) in [(1, 1), (2, 1), (1, 2), (4, 2), (2, 4)] {
                        for (prompt, cached) in [(12, 0), (10, 0), (12, 1)] {
                            check_bytes(fused, (p_tp, 1), d_tp, (4, 4), prompt, cached);
                        }
                        check_bytes(fused, (p_tp, 2), d_tp, (4, 4), 9, 0);
                    }
                }
                // Each head's token its K then its V (vLLM 0.33): tokens stand apart, so every
                // TP and block-size ratio moves as K/V-split layouts do.
                let packed = small(order, placement, Attention::PackedKv);
                for (p_tp, d_tp) in [(1, 1), (2, 1), (1, 2), (4, 2), (2, 8)] {
                    for (sizes, prompt, cached) in [((4, 4), 12, 1), ((2, 8), 10, 0), ((8, 4), 20, 1)] {
                        check_bytes(packed, (p_tp, 1), d_tp, sizes, prompt, cached);
                    }
                    check_bytes(packed, (p_tp, 2), d_tp, (4, 4), 9, 0);
                }
                let mla = KvLayout { kv_heads: 1, ..small(order, placement, Attention::Mla) };
                for (p_tp, d_tp) in [(1, 2), (2, 1), (4, 2)] {
                    for p_pp in [1, 2] {
                        check_bytes(mla, (p_tp, p_pp), d_tp, (2, 4), 6, 0);
                        check_bytes(mla, (p_tp, p_pp), d_tp, (4, 2), 7, 1);
                    }
                }
            }
        }
    }

    #[test]
    fn push_plans_swap_local_and_remote() {
        let layout = llama_like(Placement::BlockMajor);
        let shape = PoolShape::new(layout, 8, 64).unwrap();
        let (p_regions, d_regions) = (regions(&shape, 1 << 40), regions(&shape, 1 << 20));
        let (p_ids, d_ids) = (ids(&[1, 2]), ids(&[5, 6]));
        let mut input = PlanInput {
            prefill: PoolSide { shape, regions: &p_regions, blocks: &p_ids },
            decode: PoolSide { shape, regions: &d_regions, blocks: &d_ids },
            skip_tokens: 0,
            slice: full_slice(8),
            initiator: Initiator::Decode,
        };
        let pull = TransferPlan::build(&input, Granularity::Merged).unwrap();
        input.initiator = Initiator::Prefill;
        let push = TransferPlan::build(&input, Granularity::Merged).unwrap();
        assert_eq!(pull.len(), 1);
        assert_eq!(push.pairs()[0].local_addr, pull.pairs()[0].remote_addr);
        assert_eq!(push.pairs()[0].remote_addr, pull.pairs()[0].local_addr);
    }

    #[test]
    fn bad_inputs_are_errors_that_name_the_values() {
        let layout = llama_like(Placement::BlockMajor);
        let shape = PoolShape::new(layout, 8, 4).unwrap();
        let good = regions(&shape, 0);
        let (p_ids, d_ids) = (ids(&[1, 2]), ids(&[0, 1]));
        let base = PlanInput {
            prefill: PoolSide { shape, regions: &good, blocks: &p_ids },
            decode: PoolSide { shape, regions: &good, blocks: &d_ids },
            skip_tokens: 0,
            slice: full_slice(8),
            initiator: Initiator::Decode,
        };
        let err = |input: PlanInput<'_>| TransferPlan::build(&input, Granularity::Merged).unwrap_err().to_string();

        let far = ids(&[1, 4]);
        let e = err(PlanInput { prefill: PoolSide { blocks: &far, ..base.prefill }, ..base });
        assert_eq!(e, "prefill block 4 is outside its pool of 4 blocks");

        let small = [RegionBase { addr: 0, len: 10 }];
        let e = err(PlanInput { decode: PoolSide { regions: &small, ..base.decode }, ..base });
        assert_eq!(e, format!("decode region 0 is 10 bytes, its pool needs {}", shape.region_len()));

        let none: [RegionBase; 0] = [];
        let e = err(PlanInput { decode: PoolSide { regions: &none, ..base.decode }, ..base });
        assert_eq!(e, "decode pool has 0 regions, its layout has 1");

        let e = err(PlanInput { slice: HeadSlice { decode_head: 6, ..full_slice(4) }, ..base });
        assert_eq!(e, "head slice 6..10 does not fit the decode rank's 8 heads");

        let odd = PoolShape::new(layout.with_block_tokens(24), 8, 4).unwrap();
        let e = err(PlanInput { prefill: PoolSide { shape: odd, regions: &regions(&odd, 0), ..base.prefill }, ..base });
        assert_eq!(
            e,
            "block size mismatch: neither the prefill block of 24 tokens nor the decode block of 16 tokens is a multiple of the other"
        );

        let e = TransferPlan::build_layers(&base, Granularity::Merged, 40..50).unwrap_err().to_string();
        assert_eq!(e, "layers 40..50 are none of the layers 0..32 both pools hold");

        let one = ids(&[0]);
        let e = err(PlanInput { decode: PoolSide { blocks: &one, ..base.decode }, ..base });
        assert_eq!(e, "1 decode blocks of 16 tokens cannot hold 32 tokens of prefill blocks");

        let bigger = PoolShape::new(layout.with_block_tokens(32), 8, 4).unwrap();
        let e = err(PlanInput {
            prefill: PoolSide { shape: bigger, regions: &regions(&bigger, 0), blocks: &one },
            skip_tokens: 16,
            ..base
        });
        assert_eq!(e, "2 decode blocks of 16 tokens need more than 16 tokens of prefill blocks");

        let other = PoolShape::new(KvLayout { head_dim: 64, ..layout }, 8, 4).unwrap();
        let e =
            err(PlanInput { decode: PoolSide { shape: other, regions: &regions(&other, 0), ..base.decode }, ..base });
        assert!(e.starts_with("kv layout mismatch: prefill KvLayout"), "{e}");
        assert!(e.contains("head_dim: 128") && e.contains("head_dim: 64"), "{e}");

        let e = err(PlanInput { prefill: PoolSide { blocks: &[], ..base.prefill }, ..base });
        assert_eq!(e, "no prefill blocks to transfer");
    }
}
