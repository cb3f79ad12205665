//! Where the model keeps a sequence's KV: [`KvStore`], and a sequence's blocks in kvflow's
//! pools, one pool per TP rank of an engine, each holding the KV heads its rank owns, at the
//! offsets the pool's layout names (the layout the engine's handshake describes): in memory the
//! caller holds as byte slices, or behind kv-core's `Memory` port, as an engine's pools are
//! ([`PoolKv`]).

use kv_core::{BlockId, Dtype, Memory, MemoryOrder, PoolShape, RegionId};

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

/// Where each (layer, plane, head, position) of a sequence lies in an engine's pools: `shapes`
/// by TP rank, the sequence's position `p` in block `blocks[p / block_tokens]` of every rank
/// (an engine allocates a request the same block ids on all of them). A KV head is written to
/// every rank that holds it (more ranks than heads replicate) and read from the first.
struct KvMap<'a> {
    shapes: Vec<PoolShape>,
    blocks: &'a [BlockId],
}

impl<'a> KvMap<'a> {
    /// An error if the pools are not f32 K/V-split pools of one layout.
    fn new(shapes: Vec<PoolShape>, blocks: &'a [BlockId]) -> Result<Self, ModelError> {
        let first = shapes.first().ok_or_else(|| ModelError::Kv("no TP rank's pool".into()))?;
        for (r, shape) in shapes.iter().enumerate() {
            let layout = shape.layout;
            if layout != first.layout || layout.dtype != Dtype::Float32 || layout.planes() != 2 {
                return Err(ModelError::Kv(format!(
                    "rank {r}'s pool is {layout:?}: the model keeps its KV in f32 K/V-split pools of one layout"
                )));
            }
        }
        Ok(KvMap { shapes, blocks })
    }

    /// The ranks that hold KV head `head`, each with the head's index in its pool.
    fn holders(&self, head: usize) -> impl Iterator<Item = (usize, u32)> + '_ {
        let tp = self.shapes.len() as u32;
        self.shapes.iter().enumerate().filter_map(move |(r, shape)| {
            let first = shape.layout.first_head(r as u32, tp) as usize;
            let local = head.checked_sub(first).filter(|&h| h < shape.heads as usize)?;
            Some((r, local as u32))
        })
    }

    /// Where (`layer`, `plane`, local head `local`, `position`) lies in `rank`'s pool: the
    /// pool region and the byte offset in it.
    fn locate(
        &self,
        rank: usize,
        layer: usize,
        plane: usize,
        local: u32,
        position: usize,
    ) -> Result<(usize, u64), ModelError> {
        let shape = &self.shapes[rank];
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
        Ok((at.region as usize, at.offset + within))
    }

    /// Every place (rank, pool region, offset) that holds (`layer`, `plane`, `head`,
    /// `position`): the writes' targets; the first is where reads come from.
    fn places(
        &self,
        layer: usize,
        plane: usize,
        head: usize,
        position: usize,
    ) -> Result<Vec<(usize, usize, u64)>, ModelError> {
        let places = self
            .holders(head)
            .map(|(rank, local)| self.locate(rank, layer, plane, local, position).map(|(r, o)| (rank, r, o)))
            .collect::<Result<Vec<_>, _>>()?;
        if places.is_empty() {
            return Err(ModelError::Kv(format!("no rank holds KV head {head}")));
        }
        Ok(places)
    }
}

/// One TP rank's pool held as byte slices: its shape and its regions' memory, in region order.
pub struct RankMemory<'a> {
    /// The rank's pool shape (its heads, its engine's block size and layout).
    pub shape: PoolShape,
    /// The pool's regions, as [`PoolShape::region_count`] and [`PoolShape::region_len`] say.
    pub regions: Vec<&'a mut [u8]>,
}

/// Where one rank's pool lies behind the `Memory` port: for each of its pool regions, the
/// memory region and the offset in it where the pool region starts (an engine may keep a
/// rank's whole pool in one allocation, its pool regions one after another).
pub struct RankRegions {
    /// The rank's pool shape.
    pub shape: PoolShape,
    /// `(memory region, offset)` of each pool region, in region order.
    pub regions: Vec<(RegionId, u64)>,
}

/// Where the pools' bytes are.
enum Backing<'a> {
    /// Each rank's regions, as slices.
    Slices(Vec<Vec<&'a mut [u8]>>),
    /// Behind the `Memory` port: each rank's regions as (memory region, offset).
    Memory { memory: &'a mut dyn Memory, regions: Vec<Vec<(RegionId, u64)>> },
}

/// A sequence's KV in an engine's pools, one per TP rank in rank order, the sequence in
/// `blocks` of every rank: pools held as byte slices ([`PoolKv::new`]), or behind kv-core's
/// `Memory` port, as an engine that moves them with kvflow holds them ([`PoolKv::in_memory`]).
pub struct PoolKv<'a> {
    map: KvMap<'a>,
    backing: Backing<'a>,
}

impl<'a> PoolKv<'a> {
    /// The sequence in `blocks` of the pools `ranks`; an error if the pools are not f32
    /// K/V-split pools of one layout, or their regions are not the shape's.
    pub fn new(ranks: Vec<RankMemory<'a>>, blocks: &'a [BlockId]) -> Result<Self, ModelError> {
        for (r, rank) in ranks.iter().enumerate() {
            let (count, len) = (rank.shape.region_count() as usize, rank.shape.region_len());
            if rank.regions.len() != count || rank.regions.iter().any(|r| r.len() as u64 != len) {
                return Err(ModelError::Kv(format!(
                    "rank {r}'s pool has {} regions, its shape {count} of {len} bytes",
                    rank.regions.len()
                )));
            }
        }
        let (shapes, regions) = ranks.into_iter().map(|r| (r.shape, r.regions)).unzip();
        Ok(PoolKv { map: KvMap::new(shapes, blocks)?, backing: Backing::Slices(regions) })
    }

    /// The sequence in `blocks` of the pools `ranks` in `memory`; an error if the pools are
    /// not f32 K/V-split pools of one layout, or a rank names other than its shape's count of
    /// regions.
    pub fn in_memory(
        memory: &'a mut dyn Memory,
        ranks: Vec<RankRegions>,
        blocks: &'a [BlockId],
    ) -> Result<Self, ModelError> {
        for (r, rank) in ranks.iter().enumerate() {
            if rank.regions.len() != rank.shape.region_count() as usize {
                return Err(ModelError::Kv(format!(
                    "rank {r} names {} regions, its pool shape has {}",
                    rank.regions.len(),
                    rank.shape.region_count()
                )));
            }
        }
        let (shapes, regions) = ranks.into_iter().map(|r| (r.shape, r.regions)).unzip();
        Ok(PoolKv { map: KvMap::new(shapes, blocks)?, backing: Backing::Memory { memory, regions } })
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
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        for (rank, region, offset) in self.map.places(layer, plane, head, position)? {
            match &mut self.backing {
                Backing::Slices(regions) => {
                    let at = offset as usize;
                    regions[rank][region][at..at + bytes.len()].copy_from_slice(&bytes);
                }
                Backing::Memory { memory, regions } => {
                    let (id, base) = regions[rank][region];
                    memory.write(id, base + offset, &bytes).map_err(|e| ModelError::Kv(e.to_string()))?;
                }
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
        let (rank, region, offset) = self.map.places(layer, plane, head, position)?[0];
        let mut bytes = vec![0u8; 4 * out.len()];
        match &self.backing {
            Backing::Slices(regions) => {
                let (at, len) = (offset as usize, bytes.len());
                bytes.copy_from_slice(&regions[rank][region][at..at + len]);
            }
            Backing::Memory { memory, regions } => {
                let (id, base) = regions[rank][region];
                memory.read(id, base + offset, &mut bytes).map_err(|e| ModelError::Kv(e.to_string()))?;
            }
        }
        for (value, chunk) in out.iter_mut().zip(bytes.chunks_exact(4)) {
            *value = f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        }
        Ok(())
    }
}
