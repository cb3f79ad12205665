//! The shape of a KV pool: what a block holds and where each byte of it lives.
//!
//! A pool is `num_blocks` blocks. Within one layer of one block, the bytes are
//! `[plane][...]`, with two planes (K, then V) or one (the MLA latent), and each plane is
//! `[head][token][dim]` (HND, heads-major) or `[token][head][dim]` (NHD). HND keeps a head
//! slice contiguous, which is what lets a heterogeneous-TP read merge into few descriptors.
//! Layers are placed block-major (one region, `[block][layer]`, as Dynamo's fully contiguous
//! layout) or layer-major (one region per layer, `[block]` within it, as vLLM's per-layer
//! tensors).

use serde::{Deserialize, Serialize};

/// The element format of the KV cache, named as vLLM's `kv_cache_dtype` names it: two
/// formats of one size (fp8's e4m3 and e5m2) are not interchangeable, so the handshake compares
/// the format itself, not its size.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum Dtype {
    /// IEEE 754 single precision, 4 bytes.
    #[serde(rename = "float32")]
    Float32,
    /// IEEE 754 half precision, 2 bytes.
    #[serde(rename = "float16")]
    Float16,
    /// bfloat16, 2 bytes.
    #[serde(rename = "bfloat16")]
    Bfloat16,
    /// 8-bit float, 4 exponent and 3 mantissa bits (OCP FP8 E4M3).
    #[serde(rename = "fp8_e4m3")]
    Fp8E4m3,
    /// 8-bit float, 5 exponent and 2 mantissa bits (OCP FP8 E5M2).
    #[serde(rename = "fp8_e5m2")]
    Fp8E5m2,
}

impl Dtype {
    /// Every format, in the order of their wire indices.
    pub const ALL: [Dtype; 5] = [Dtype::Float32, Dtype::Float16, Dtype::Bfloat16, Dtype::Fp8E4m3, Dtype::Fp8E5m2];

    /// Bytes per element.
    pub fn bytes(self) -> u32 {
        match self {
            Dtype::Float32 => 4,
            Dtype::Float16 | Dtype::Bfloat16 => 2,
            Dtype::Fp8E4m3 | Dtype::Fp8E5m2 => 1,
        }
    }

    /// Its name, as vLLM's `kv_cache_dtype` writes it.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Float32 => "float32",
            Dtype::Float16 => "float16",
            Dtype::Bfloat16 => "bfloat16",
            Dtype::Fp8E4m3 => "fp8_e4m3",
            Dtype::Fp8E5m2 => "fp8_e5m2",
        }
    }

    /// Its wire index (the offer's enum index, and the compatibility hash's byte).
    pub fn index(self) -> u8 {
        self as u8
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How attention keeps its KV cache.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum Attention {
    /// Separate K and V planes, heads sharded across TP ranks.
    SplitKv,
    /// One latent plane (multi-head latent attention), replicated on every TP rank.
    Mla,
    /// One plane in which each head keeps its K and V together, `2 × head_dim` elements a
    /// token (vLLM's CPU attention: each head's K, transposed, then its V), heads sharded across
    /// TP ranks as with [`Attention::SplitKv`]. The tokens of a head inside a block cannot be
    /// told apart, so blocks move whole: P's and D's block sizes must be equal, and the order
    /// is [`MemoryOrder::Hnd`] (a head's part of a block is contiguous).
    FusedKv,
    /// One plane in which each head's token holds its K then its V, `2 × head_dim` elements
    /// (vLLM 0.33's caches: content `C` of its `[block, head, token, C]` layouts), heads sharded
    /// across TP ranks as with [`Attention::SplitKv`]; tokens stand apart, so block sizes may
    /// differ, in either order.
    PackedKv,
}

/// The order of heads and tokens within one plane of one block.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum MemoryOrder {
    /// `[head][token][dim]`: a head slice is contiguous.
    Hnd,
    /// `[token][head][dim]`: a head slice is strided by token.
    Nhd,
}

/// Where each layer of a block lives.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum Placement {
    /// One region; a block's layers are adjacent (`[block][layer]`).
    BlockMajor,
    /// One region per layer; a layer's blocks are adjacent (`[layer][block]`).
    LayerMajor,
    /// One region per layer, its planes outermost: a plane's blocks are adjacent
    /// (`[layer][plane][block]`), as vLLM's FlashAttention keeps a layer (one tensor of
    /// `(2, num_blocks, block_size, kv_heads, head_size)`, K's blocks then V's).
    LayerPlaneMajor,
}

/// The model-level shape of a KV cache; a TP rank's share follows from it and the TP size.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct KvLayout {
    /// Transformer layers.
    pub layers: u32,
    /// Tokens per block (the engine's block size).
    pub block_tokens: u32,
    /// KV heads of the whole model (1 for MLA's latent).
    pub kv_heads: u32,
    /// Elements per head (the latent width for MLA).
    pub head_dim: u32,
    /// The element format.
    pub dtype: Dtype,
    /// K/V split or MLA.
    pub attention: Attention,
    /// Order within a plane.
    pub order: MemoryOrder,
    /// Where layers live.
    pub placement: Placement,
}

/// A layout whose sizes cannot describe a pool.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum LayoutError {
    /// A dimension is zero.
    #[error("kv layout field {field} is 0")]
    Zero {
        /// The field that is zero.
        field: &'static str,
    },
    /// A fused K/V layout whose heads are not contiguous.
    #[error("a FusedKv layout keeps each head's part of a block contiguous (order Hnd), not {order:?}")]
    FusedOrder {
        /// The order given.
        order: MemoryOrder,
    },
    /// The pool's byte size does not fit in 64 bits.
    #[error("kv pool of {num_blocks} blocks overflows 64-bit sizes")]
    Overflow {
        /// Blocks asked for.
        num_blocks: u64,
    },
    /// The pipeline stages do not split the layers evenly, or a stage is out of range.
    #[error("pipeline stage {stage} of {stages} does not hold an even share of {layers} layers")]
    Stages {
        /// The model's layers.
        layers: u32,
        /// The stage asked for.
        stage: u32,
        /// The pipeline-parallel size.
        stages: u32,
    },
}

impl KvLayout {
    /// A K/V-split layout in the order and placement that transfer best: heads-major (`HND`),
    /// one block-major region; [`KvLayout::validate`] checks the sizes.
    pub fn split_kv(layers: u32, block_tokens: u32, kv_heads: u32, head_dim: u32, dtype: Dtype) -> Self {
        KvLayout {
            layers,
            block_tokens,
            kv_heads,
            head_dim,
            dtype,
            attention: Attention::SplitKv,
            order: MemoryOrder::Hnd,
            placement: Placement::BlockMajor,
        }
    }

    /// A Llama-3-8B-like layout: 32 layers, 8 KV heads of 128, bf16; 2 MiB a block at 16 tokens.
    pub fn llama3_8b(block_tokens: u32) -> Self {
        KvLayout::split_kv(32, block_tokens, 8, 128, Dtype::Bfloat16)
    }

    /// Checks that every dimension is non-zero.
    pub fn validate(&self) -> Result<(), LayoutError> {
        for (field, value) in [
            ("layers", self.layers),
            ("block_tokens", self.block_tokens),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
        ] {
            if value == 0 {
                return Err(LayoutError::Zero { field });
            }
        }
        if self.attention == Attention::FusedKv && self.order != MemoryOrder::Hnd {
            return Err(LayoutError::FusedOrder { order: self.order });
        }
        Ok(())
    }

    /// Planes per layer: 2 for K/V, 1 for the MLA latent and for fused or packed K/V.
    pub fn planes(&self) -> u32 {
        match self.attention {
            Attention::SplitKv => 2,
            Attention::Mla | Attention::FusedKv | Attention::PackedKv => 1,
        }
    }

    /// Elements of one head for one token in one plane: `head_dim`, twice that for fused or
    /// packed K/V.
    pub fn head_elements(&self) -> u64 {
        let per_plane = match self.attention {
            Attention::SplitKv | Attention::Mla => 1,
            Attention::FusedKv | Attention::PackedKv => 2,
        };
        u64::from(self.head_dim) * per_plane
    }

    /// Whether blocks move only whole (fused K/V): P's and D's block sizes must be equal.
    pub fn whole_blocks_only(&self) -> bool {
        self.attention == Attention::FusedKv
    }

    /// Whether the KV is replicated on every rank (MLA).
    pub fn is_mla(&self) -> bool {
        self.attention == Attention::Mla
    }

    /// KV heads each rank of a `tp`-wide engine holds: all of MLA's one latent, else
    /// `kv_heads / tp`, at least one (ranks beyond the head count replicate).
    pub fn heads_per_rank(&self, tp: u32) -> u32 {
        match self.attention {
            Attention::Mla => 1,
            Attention::SplitKv | Attention::FusedKv | Attention::PackedKv => (self.kv_heads / tp.max(1)).max(1),
        }
    }

    /// The model-wide index of the first head rank `rank` of a `tp`-wide engine holds (it holds
    /// [`KvLayout::heads_per_rank`] from there): 0 for MLA's latent, which every rank holds;
    /// ranks beyond the head count share heads, `tp / kv_heads` to a head.
    pub fn first_head(&self, rank: u32, tp: u32) -> u32 {
        let tp = tp.max(1);
        match self.attention {
            Attention::Mla => 0,
            Attention::SplitKv | Attention::FusedKv | Attention::PackedKv if tp <= self.kv_heads => {
                rank * (self.kv_heads / tp)
            }
            Attention::SplitKv | Attention::FusedKv | Attention::PackedKv => rank / (tp / self.kv_heads.max(1)),
        }
    }

    /// The same layout with another block size (P and D may differ in nothing else).
    pub fn with_block_tokens(self, block_tokens: u32) -> Self {
        KvLayout { block_tokens, ..self }
    }
}

/// One rank's pool: the layout, the heads and layers this rank holds, and how many blocks it has.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct PoolShape {
    /// The model's layout, with this engine's block size.
    pub layout: KvLayout,
    /// KV heads held by this rank.
    pub heads: u32,
    /// Blocks in the pool.
    pub num_blocks: u32,
    /// The model's layers this rank holds: all of them, or its pipeline stage's run.
    pub layers: LayerRange,
}

/// A run of the model's layers: those a pipeline-parallel stage holds, or all of them.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct LayerRange {
    /// The first layer, as the model numbers them.
    pub first: u32,
    /// Layers in the run.
    pub count: u32,
}

impl LayerRange {
    /// One past the last layer.
    pub fn end(&self) -> u32 {
        self.first + self.count
    }

    /// The layers both runs hold, as model layer numbers.
    pub fn common(&self, other: &LayerRange) -> std::ops::Range<u32> {
        self.first.max(other.first)..self.end().min(other.end())
    }
}

/// Where one `(layer, block, plane)` starts: a region index and a byte offset in it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct PlaneOffset {
    /// Index of the region in the pool's region list.
    pub region: u32,
    /// Byte offset within the region.
    pub offset: u64,
}

impl PoolShape {
    /// A rank's pool shape; fails when a dimension is zero or the pool overflows.
    pub fn new(layout: KvLayout, heads: u32, num_blocks: u32) -> Result<Self, LayoutError> {
        layout.validate()?;
        if heads == 0 {
            return Err(LayoutError::Zero { field: "heads" });
        }
        let shape = PoolShape { layout, heads, num_blocks, layers: LayerRange { first: 0, count: layout.layers } };
        // Every offset the pool can name is below the region size, so checking it once here
        // makes every later offset computation overflow-free.
        shape.checked_region_len().ok_or(LayoutError::Overflow { num_blocks: u64::from(num_blocks) })?;
        Ok(shape)
    }

    /// The pool of pipeline stage `stage` of `stages`, which holds the model's layers
    /// `stage * L / stages ..` (`L / stages` of them); fails when the stages do not split the
    /// layers evenly or `stage` is not below `stages`.
    pub fn for_stage(self, stage: u32, stages: u32) -> Result<Self, LayoutError> {
        let layers = self.layout.layers;
        if stages == 0 || layers % stages != 0 || stage >= stages {
            return Err(LayoutError::Stages { layers, stage, stages });
        }
        let count = layers / stages;
        Ok(PoolShape { layers: LayerRange { first: stage * count, count }, ..self })
    }

    fn checked_region_len(&self) -> Option<u64> {
        let per_region_blocks = match self.layout.placement {
            Placement::BlockMajor => u64::from(self.layers.count),
            Placement::LayerMajor | Placement::LayerPlaneMajor => 1,
        };
        self.checked_layer_block_bytes()?.checked_mul(per_region_blocks)?.checked_mul(u64::from(self.num_blocks))
    }

    fn checked_layer_block_bytes(&self) -> Option<u64> {
        u64::from(self.layout.planes())
            .checked_mul(u64::from(self.heads))?
            .checked_mul(u64::from(self.layout.block_tokens))?
            .checked_mul(self.head_bytes_per_token())
    }

    /// Bytes of one head for one token in one plane.
    pub fn head_bytes_per_token(&self) -> u64 {
        self.layout.head_elements() * u64::from(self.layout.dtype.bytes())
    }

    /// Bytes of one plane of one layer of one block.
    pub fn plane_bytes(&self) -> u64 {
        u64::from(self.heads) * u64::from(self.layout.block_tokens) * self.head_bytes_per_token()
    }

    /// Bytes of one layer of one block.
    pub fn layer_block_bytes(&self) -> u64 {
        u64::from(self.layout.planes()) * self.plane_bytes()
    }

    /// Bytes of one block, all layers.
    pub fn block_bytes(&self) -> u64 {
        u64::from(self.layers.count) * self.layer_block_bytes()
    }

    /// Regions the pool is made of.
    pub fn region_count(&self) -> u32 {
        match self.layout.placement {
            Placement::BlockMajor => 1,
            Placement::LayerMajor | Placement::LayerPlaneMajor => self.layers.count,
        }
    }

    /// Groups of [`PoolShape::block_descriptors`], each one entry per block: one in a
    /// block-major pool, one per layer in a layer-major one, one per (layer, plane) in a
    /// layer-plane-major one.
    pub fn descriptor_groups(&self) -> u32 {
        match self.layout.placement {
            Placement::BlockMajor => 1,
            Placement::LayerMajor => self.layers.count,
            Placement::LayerPlaneMajor => self.layers.count * self.layout.planes(),
        }
    }

    /// Bytes of each region.
    pub fn region_len(&self) -> u64 {
        self.checked_region_len().expect("checked in PoolShape::new")
    }

    /// Bytes of the whole pool.
    pub fn pool_bytes(&self) -> u64 {
        self.region_len() * u64::from(self.region_count())
    }

    /// The pool's blocks as `(address, length)` ranges to prepare once with a transport: one
    /// per block in a block-major pool, one per (layer, block) in a layer-major one, one per
    /// (layer, plane, block) in a layer-plane-major one, in the order
    /// [`PoolShape::descriptor_index`] numbers them. `bases` are the regions' addresses.
    pub fn block_descriptors(&self, bases: &[u64]) -> Vec<(u64, u64)> {
        (0..self.descriptor_groups()).flat_map(|group| self.group_ranges(bases, group)).collect()
    }

    /// Descriptor group `group`'s range of each block, in block order.
    fn group_ranges(&self, bases: &[u64], group: u32) -> impl Iterator<Item = (u64, u64)> + '_ {
        let (base, first, len) = self.group_base(bases, group);
        (0..u64::from(self.num_blocks)).map(move |b| (base + first + b * len, len))
    }

    /// Descriptor group `group`'s region base, the offset of its block 0 there, and the bytes
    /// of each block's range in it.
    fn group_base(&self, bases: &[u64], group: u32) -> (u64, u64, u64) {
        match self.layout.placement {
            Placement::BlockMajor => (bases.first().copied().unwrap_or(0), 0, self.block_bytes()),
            Placement::LayerMajor => (bases.get(group as usize).copied().unwrap_or(0), 0, self.layer_block_bytes()),
            Placement::LayerPlaneMajor => {
                let (layer, plane) = (group / self.layout.planes(), group % self.layout.planes());
                let base = bases.get(layer as usize).copied().unwrap_or(0);
                (base, u64::from(plane) * u64::from(self.num_blocks) * self.plane_bytes(), self.plane_bytes())
            }
        }
    }

    /// Where block `block` lies in the pool: one `(address, length)` range in a block-major
    /// pool, one per layer in a layer-major one, one per (layer, plane) in a layer-plane-major
    /// one. `bases` are the regions' addresses.
    pub fn block_ranges(&self, bases: &[u64], block: u32) -> Vec<(u64, u64)> {
        (0..self.descriptor_groups())
            .map(|group| {
                let (base, first, len) = self.group_base(bases, group);
                (base + first + u64::from(block) * len, len)
            })
            .collect()
    }

    /// The entry of [`PoolShape::block_descriptors`] that holds `block` in descriptor group
    /// `group` (the layer, counted from the pool's first, in a layer-major pool; `layer *
    /// planes + plane` in a layer-plane-major one; 0 in a block-major one).
    pub fn descriptor_index(&self, group: u32, block: u32) -> u32 {
        match self.layout.placement {
            Placement::BlockMajor => block,
            Placement::LayerMajor | Placement::LayerPlaneMajor => group * self.num_blocks + block,
        }
    }

    /// The block whose bytes `offset` of region `region` is in; none past the pool.
    pub fn block_at(&self, region: u32, offset: u64) -> Option<u32> {
        if region >= self.region_count() || offset >= self.region_len() {
            return None;
        }
        let block = match self.layout.placement {
            Placement::BlockMajor => offset / self.block_bytes(),
            Placement::LayerMajor => offset / self.layer_block_bytes(),
            Placement::LayerPlaneMajor => {
                offset % (u64::from(self.num_blocks) * self.plane_bytes()) / self.plane_bytes()
            }
        };
        u32::try_from(block).ok()
    }

    /// Where `(layer, block, plane)` starts, `layer` as the model numbers it (one of the pool's
    /// [`PoolShape::layers`]); the caller keeps the indices in range.
    pub fn plane_offset(&self, layer: u32, block: u32, plane: u32) -> PlaneOffset {
        let layer = layer - self.layers.first;
        let plane_start = u64::from(plane) * self.plane_bytes();
        match self.layout.placement {
            Placement::BlockMajor => PlaneOffset {
                region: 0,
                offset: u64::from(block) * self.block_bytes()
                    + u64::from(layer) * self.layer_block_bytes()
                    + plane_start,
            },
            Placement::LayerMajor => {
                PlaneOffset { region: layer, offset: u64::from(block) * self.layer_block_bytes() + plane_start }
            }
            Placement::LayerPlaneMajor => PlaneOffset {
                region: layer,
                offset: u64::from(plane) * u64::from(self.num_blocks) * self.plane_bytes()
                    + u64::from(block) * self.plane_bytes(),
            },
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn llama_like(placement: Placement) -> KvLayout {
        KvLayout {
            layers: 32,
            block_tokens: 16,
            kv_heads: 8,
            head_dim: 128,
            dtype: Dtype::Bfloat16,
            attention: Attention::SplitKv,
            order: MemoryOrder::Hnd,
            placement,
        }
    }

    #[test]
    fn each_rank_holds_its_slice_of_heads_or_shares_one() {
        let split = llama_like(Placement::BlockMajor); // 8 heads
        let heads = |tp: u32| (0..tp).map(|r| (split.first_head(r, tp), split.heads_per_rank(tp))).collect::<Vec<_>>();
        assert_eq!(heads(2), [(0, 4), (4, 4)]);
        assert_eq!(heads(8), (0..8).map(|h| (h, 1)).collect::<Vec<_>>());
        assert_eq!(heads(16)[..4], [(0, 1), (0, 1), (1, 1), (1, 1)], "two ranks to a head");
        let mla = KvLayout { attention: Attention::Mla, kv_heads: 1, ..split };
        assert_eq!((mla.first_head(3, 4), mla.heads_per_rank(4)), (0, 1), "every rank holds the latent");
    }

    #[test]
    fn fused_kv_is_one_plane_of_whole_heads() {
        let fused = KvLayout { attention: Attention::FusedKv, ..llama_like(Placement::LayerMajor) };
        let shape = PoolShape::new(fused, 4, 10).unwrap();
        // K and V of a head together: what SplitKv keeps in two planes, in one.
        assert_eq!(shape.layer_block_bytes(), 2 * 4 * 16 * 128 * 2);
        assert_eq!((fused.planes(), shape.head_bytes_per_token()), (1, 2 * 128 * 2));
        assert_eq!((fused.first_head(1, 2), fused.heads_per_rank(2)), (4, 4), "heads split as K/V's");
        let nhd = KvLayout { order: MemoryOrder::Nhd, ..fused };
        assert_eq!(
            nhd.validate().unwrap_err().to_string(),
            "a FusedKv layout keeps each head's part of a block contiguous (order Hnd), not Nhd"
        );
    }

    #[test]
    fn sizes_follow_the_layout() {
        let shape = PoolShape::new(llama_like(Placement::BlockMajor), 8, 10).unwrap();
        assert_eq!(shape.plane_bytes(), 8 * 16 * 128 * 2);
        assert_eq!(shape.block_bytes(), 32 * 2 * 8 * 16 * 128 * 2);
        assert_eq!(shape.region_count(), 1);
        assert_eq!(shape.pool_bytes(), 10 * shape.block_bytes());
        assert_eq!(
            shape.plane_offset(1, 2, 1),
            PlaneOffset {
                region: 0,
                offset: 2 * shape.block_bytes() + shape.layer_block_bytes() + shape.plane_bytes()
            }
        );

        let shape = PoolShape::new(llama_like(Placement::LayerMajor), 4, 10).unwrap();
        assert_eq!(shape.region_count(), 32);
        assert_eq!(shape.region_len(), 10 * shape.layer_block_bytes());
        assert_eq!(shape.pool_bytes(), 10 * shape.block_bytes());
        assert_eq!(shape.plane_offset(5, 3, 0), PlaneOffset { region: 5, offset: 3 * shape.layer_block_bytes() });
    }

    #[test]
    fn a_pipeline_stage_holds_its_share_of_the_layers() {
        let model = PoolShape::new(llama_like(Placement::BlockMajor), 8, 10).unwrap();
        let stage = model.for_stage(1, 2).unwrap();
        assert_eq!(stage.layers, LayerRange { first: 16, count: 16 });
        assert_eq!(2 * stage.block_bytes(), model.block_bytes());
        assert_eq!(stage.plane_offset(16, 3, 0), PlaneOffset { region: 0, offset: 3 * stage.block_bytes() });
        let layered = PoolShape::new(llama_like(Placement::LayerMajor), 8, 10).unwrap().for_stage(3, 4).unwrap();
        assert_eq!((layered.region_count(), layered.plane_offset(25, 0, 0).region), (8, 1));
        for (stage, stages) in [(0, 3), (2, 2), (0, 0)] {
            assert_eq!(model.for_stage(stage, stages), Err(LayoutError::Stages { layers: 32, stage, stages }));
        }
        assert_eq!(stage.layers.common(&model.layers), 16..32);
        assert!(stage.layers.common(&model.for_stage(0, 2).unwrap().layers).is_empty());
    }

    const PLACEMENTS: [Placement; 3] = [Placement::BlockMajor, Placement::LayerMajor, Placement::LayerPlaneMajor];

    /// The descriptor group that holds `(layer, plane)`.
    fn group(shape: &PoolShape, layer: u32, plane: u32) -> u32 {
        match shape.layout.placement {
            Placement::BlockMajor => 0,
            Placement::LayerMajor => layer,
            Placement::LayerPlaneMajor => layer * shape.layout.planes() + plane,
        }
    }

    #[test]
    fn block_descriptors_cover_the_pool_in_index_order() {
        for placement in PLACEMENTS {
            let shape = PoolShape::new(llama_like(placement), 8, 10).unwrap();
            let bases: Vec<u64> =
                (0..u64::from(shape.region_count())).map(|i| (1 << 40) + i * shape.region_len()).collect();
            let descs = shape.block_descriptors(&bases);
            let total: u64 = descs.iter().map(|&(_, len)| len).sum();
            assert_eq!(total, shape.pool_bytes(), "{placement:?}");
            assert_eq!(descs.len() as u32, shape.descriptor_groups() * 10, "{placement:?}");
            for (layer, block, plane) in (0..32).flat_map(|l| (0..10).flat_map(move |b| (0..2).map(move |p| (l, b, p))))
            {
                let (addr, len) = descs[shape.descriptor_index(group(&shape, layer, plane), block) as usize];
                let at = shape.plane_offset(layer, block, plane);
                let start = bases[at.region as usize] + at.offset;
                assert!(
                    addr <= start && start + shape.plane_bytes() <= addr + len,
                    "{placement:?} {layer} {block} {plane}"
                );
                assert_eq!(shape.block_at(at.region, at.offset), Some(block), "{placement:?} {layer} {block} {plane}");
            }
        }
        // FlashAttention's layer: K's blocks, then V's.
        let shape = PoolShape::new(llama_like(Placement::LayerPlaneMajor), 8, 10).unwrap();
        let v = shape.plane_offset(3, 2, 1);
        assert_eq!((v.region, v.offset), (3, (10 + 2) * shape.plane_bytes()));
        assert_eq!(shape.block_at(0, shape.region_len()), None);
    }

    #[test]
    fn a_blocks_ranges_are_its_descriptors() {
        for placement in PLACEMENTS {
            let shape = PoolShape::new(llama_like(placement), 8, 10).unwrap();
            let bases: Vec<u64> =
                (0..u64::from(shape.region_count())).map(|i| (1 << 40) + i * shape.region_len()).collect();
            let descs = shape.block_descriptors(&bases);
            for block in 0..10 {
                let want: Vec<(u64, u64)> = (0..shape.descriptor_groups())
                    .map(|group| descs[shape.descriptor_index(group, block) as usize])
                    .collect();
                assert_eq!(shape.block_ranges(&bases, block), want, "{placement:?} {block}");
            }
        }
    }

    #[test]
    fn bad_shapes_are_errors() {
        let zero_layers = KvLayout { layers: 0, ..llama_like(Placement::BlockMajor) };
        assert_eq!(PoolShape::new(zero_layers, 8, 1), Err(LayoutError::Zero { field: "layers" }));
        assert_eq!(PoolShape::new(llama_like(Placement::BlockMajor), 0, 1), Err(LayoutError::Zero { field: "heads" }));
        let huge = KvLayout { head_dim: u32::MAX, dtype: Dtype::Float32, ..llama_like(Placement::BlockMajor) };
        assert_eq!(
            PoolShape::new(huge, u32::MAX, u32::MAX),
            Err(LayoutError::Overflow { num_blocks: u64::from(u32::MAX) })
        );
    }
}
