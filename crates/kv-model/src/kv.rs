//! Where the model keeps a sequence's KV: [`KvStore`], and [`PoolKv`], a sequence's blocks in
//! kvflow's pools, one pool per TP rank of an engine, each holding the KV heads its rank owns,
//! at the offsets the pool's layout names (the layout the engine's handshake describes).

use kv_core::{BlockId, Dtype, MemoryOrder, PoolShape};

use crate::ModelError;

/// Where a sequence's KV is read and written: the K (plane 0) or V (plane 1) of one KV head at
/// one position of one layer, `head_dim` values.
pub trait KvStore {
    /// Writes `values` at (`layer`, `plane`, `head`, `position`).
    fn write(
        &mut self,
        layer: usize,
        plane: usize,
        head: usize,
        position: usize,
        values: &[f32],
    ) -> Result<(), ModelError>;

    /// Reads (`layer`, `plane`, `head`, `position`) into `out`.
    fn read(&self, layer: usize, plane: usize, head: usize, position: usize, out: &mut [f32])
        -> Result<(), ModelError>;
}

/// One TP rank's pool: its shape and its regions' memory, in region order.
pub struct RankMemory<'a> {
    /// The rank's pool shape (its heads, its engine's block size and layout).
    pub shape: PoolShape,
    /// The pool's regions, as [`PoolShape::region_count`] and [`PoolShape::region_len`] say.
    pub regions: Vec<&'a mut [u8]>,
}

/// A sequence's KV in an engine's pools: `ranks[r]` is TP rank `r`'s pool, and the sequence's
/// position `p` lies in block `blocks[p / block_tokens]` of every rank (an engine allocates a
/// request the same block ids on all of them). Each KV head is written to every rank that
/// holds it (more ranks than heads replicate) and read from the first.
pub struct PoolKv<'a> {
    ranks: Vec<RankMemory<'a>>,
    blocks: &'a [BlockId],
}

impl<'a> PoolKv<'a> {
    /// The sequence in `blocks` of the pools `ranks` (TP rank order); an error if the pools
    /// are not f32 K/V-split pools of one layout, or their regions are not the shape's.
    pub fn new(ranks: Vec<RankMemory<'a>>, blocks: &'a [BlockId]) -> Result<Self, ModelError> {
        let first = ranks.first().ok_or_else(|| ModelError::Kv("no TP rank's pool".into()))?.shape;
        for (r, rank) in ranks.iter().enumerate() {
            let layout = rank.shape.layout;
            if layout != first.layout || layout.dtype != Dtype::Float32 || layout.planes() != 2 {
                return Err(ModelError::Kv(format!(
                    "rank {r}'s pool is {layout:?}: the model keeps its KV in f32 K/V-split pools of one layout"
                )));
            }
            let (count, len) = (rank.shape.region_count() as usize, rank.shape.region_len());
            if rank.regions.len() != count || rank.regions.iter().any(|r| r.len() as u64 != len) {
                return Err(ModelError::Kv(format!(
                    "rank {r}'s pool has {} regions, its shape {count} of {len} bytes",
                    rank.regions.len()
                )));
            }
        }
        Ok(PoolKv { ranks, blocks })
    }

    /// The ranks that hold KV head `head`, each with the head's index in its pool.
    fn holders(&self, head: usize) -> impl Iterator<Item = (usize, u32)> + '_ {
        let tp = self.ranks.len() as u32;
        self.ranks.iter().enumerate().filter_map(move |(r, rank)| {
            let first = rank.shape.layout.first_head(r as u32, tp) as usize;
            let local = head.checked_sub(first).filter(|&h| h < rank.shape.heads as usize)?;
            Some((r, local as u32))
        })
    }

    /// Where (`layer`, `plane`, local head `local`, `position`) lies in `rank`'s pool: the
    /// region and the byte offset in it.
    fn locate(
        &self,
        rank: usize,
        layer: usize,
        plane: usize,
        local: u32,
        position: usize,
    ) -> Result<(usize, usize), ModelError> {
        let shape = &self.ranks[rank].shape;
        let tokens = shape.layout.block_tokens as usize;
        let block = self.blocks.get(position / tokens).ok_or_else(|| {
            ModelError::Kv(format!(
                "position {position} is past the sequence's {} blocks of {tokens} tokens",
                self.blocks.len()
            ))
        })?;
        if block.0 >= shape.num_blocks || layer as u32 >= shape.layers.count {
            return Err(ModelError::Kv(format!(
                "block {} layer {layer} is outside the pool's {} blocks of {} layers",
                block.0, shape.num_blocks, shape.layers.count
            )));
        }
        let at = shape.plane_offset(shape.layers.first + layer as u32, block.0, plane as u32);
        let (t, h, heads) = ((position % tokens) as u64, u64::from(local), u64::from(shape.heads));
        let within = match shape.layout.order {
            MemoryOrder::Hnd => (h * tokens as u64 + t) * shape.head_bytes_per_token(),
            MemoryOrder::Nhd => (t * heads + h) * shape.head_bytes_per_token(),
        };
        Ok((at.region as usize, (at.offset + within) as usize))
    }
}

impl KvStore for PoolKv<'_> {
    fn write(
        &mut self,
        layer: usize,
        plane: usize,
        head: usize,
        position: usize,
        values: &[f32],
    ) -> Result<(), ModelError> {
        let holders: Vec<(usize, u32)> = self.holders(head).collect();
        if holders.is_empty() {
            return Err(ModelError::Kv(format!("no rank holds KV head {head}")));
        }
        for (rank, local) in holders {
            let (region, offset) = self.locate(rank, layer, plane, local, position)?;
            let bytes = &mut self.ranks[rank].regions[region][offset..offset + 4 * values.len()];
            for (chunk, value) in bytes.chunks_exact_mut(4).zip(values) {
                chunk.copy_from_slice(&value.to_le_bytes());
            }
        }
        Ok(())
    }

    fn read(
        &self,
        layer: usize,
        plane: usize,
        head: usize,
        position: usize,
        out: &mut [f32],
    ) -> Result<(), ModelError> {
        let (rank, local) =
            self.holders(head).next().ok_or_else(|| ModelError::Kv(format!("no rank holds KV head {head}")))?;
        let (region, offset) = self.locate(rank, layer, plane, local, position)?;
        let bytes = &self.ranks[rank].regions[region][offset..offset + 4 * out.len()];
        for (value, chunk) in out.iter_mut().zip(bytes.chunks_exact(4)) {
            *value = f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        }
        Ok(())
    }
}
