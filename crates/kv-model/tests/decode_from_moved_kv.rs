//! A prompt's KV computed by one engine, moved into another engine's pools by kvflow's own
//! transfer plans (TP ratios, block-size ratios, new block ids), decodes there to exactly the
//! tokens one engine gives; decoded from zeroed KV instead, the tokens change.

use kv_core::{
    BlockId, Granularity, Initiator, MemoryOrder, Placement, PlanInput, PoolShape, PoolSide, RegionBase, TpMapping,
    TransferPlan,
};
use kv_core::{Memory, MemoryKind};
use kv_model::{ModelConfig, ModelError, PoolKv, RankMemory, RankRegions, TinyLlama};

const CONFIG: ModelConfig = ModelConfig::TINY_LLAMA;
const BLOCKS: u32 = 48;

/// An engine's pools: one per TP rank, each its regions' bytes.
struct Engine {
    shapes: Vec<PoolShape>,
    memory: Vec<Vec<Vec<u8>>>,
}

impl Engine {
    fn new(tp: u32, block_tokens: u32, order: MemoryOrder, placement: Placement) -> Self {
        let layout = CONFIG.kv_layout(block_tokens, order, placement);
        let shapes: Vec<PoolShape> =
            (0..tp).map(|_| PoolShape::new(layout, layout.heads_per_rank(tp), BLOCKS).expect("a pool")).collect();
        let memory = shapes
            .iter()
            .map(|s| (0..s.region_count()).map(|_| vec![0u8; s.region_len() as usize]).collect())
            .collect();
        Engine { shapes, memory }
    }

    fn kv<'a>(&'a mut self, blocks: &'a [BlockId]) -> PoolKv<'a> {
        let ranks = self
            .shapes
            .iter()
            .zip(self.memory.iter_mut())
            .map(|(shape, regions)| RankMemory {
                shape: *shape,
                regions: regions.iter_mut().map(|r| &mut r[..]).collect(),
            })
            .collect();
        PoolKv::new(ranks, blocks).expect("the engine's pools")
    }

    /// Region `i` of every rank sits at `(rank + 1) << 40 | i << 32` in a made-up address
    /// space, so that plans name them by address.
    fn bases(&self, rank: usize) -> Vec<RegionBase> {
        let shape = &self.shapes[rank];
        (0..shape.region_count() as u64)
            .map(|i| RegionBase { addr: ((rank as u64 + 1) << 40) | (i << 32), len: shape.region_len() })
            .collect()
    }
}

/// Moves `prompt_tokens` of KV from `p`'s `p_blocks` into `d`'s `d_blocks` as kvflow's D ranks
/// read it: each D rank's reads from the P ranks its TP mapping names, by the plans kvflow
/// posts, byte ranges copied.
fn move_kv(p: &Engine, p_blocks: &[BlockId], d: &mut Engine, d_blocks: &[BlockId]) -> u64 {
    let tp = TpMapping::new(p.shapes.len() as u32, d.shapes.len() as u32, CONFIG.kv_heads as u32, false).unwrap();
    let mut moved = 0;
    for d_rank in 0..d.shapes.len() {
        let plan = tp.decode_rank(d_rank as u32).unwrap();
        for slice in &plan.reads {
            let p_rank = slice.prefill_rank as usize;
            let (p_bases, d_bases) = (p.bases(p_rank), d.bases(d_rank));
            let input = PlanInput {
                prefill: PoolSide { shape: p.shapes[p_rank], regions: &p_bases, blocks: p_blocks },
                decode: PoolSide { shape: d.shapes[d_rank], regions: &d_bases, blocks: d_blocks },
                skip_tokens: 0,
                slice: *slice,
                initiator: Initiator::Decode,
            };
            let built = TransferPlan::build(&input, Granularity::Merged).expect("a plan");
            for pair in built.pairs() {
                let (pr, dr) = (pair.remote_region as usize, pair.local_region as usize);
                let from = (pair.remote_addr - p_bases[pr].addr) as usize;
                let to = (pair.local_addr - d_bases[dr].addr) as usize;
                let len = pair.len as usize;
                d.memory[d_rank][dr][to..to + len].copy_from_slice(&p.memory[p_rank][pr][from..from + len]);
                moved += pair.len;
            }
        }
    }
    moved
}

fn blocks(ids: &[u32]) -> Vec<BlockId> {
    ids.iter().map(|&b| BlockId(b)).collect()
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 37 + salt * 101 + 5) % CONFIG.vocab as u32).collect()
}

/// One engine at TP 1: the prompt in chunks of 16, then `count` tokens after the first.
fn one_engine(model: &TinyLlama, prompt: &[u32], count: usize) -> Vec<u32> {
    model.generate_alone(prompt, 16, count, 16).unwrap().tokens
}

#[test]
fn kv_moved_by_kvflow_plans_decodes_to_one_engine_s_tokens_and_zeroed_kv_does_not() {
    let model = TinyLlama::from_seed(CONFIG, 7).unwrap();
    // (P's TP, D's TP, P's block size, D's, order, placement)
    let topologies = [
        (2, 1, 16, 16, MemoryOrder::Hnd, Placement::BlockMajor),
        (1, 2, 16, 16, MemoryOrder::Nhd, Placement::LayerMajor),
        (1, 1, 16, 32, MemoryOrder::Hnd, Placement::LayerPlaneMajor),
        (4, 2, 32, 16, MemoryOrder::Nhd, Placement::BlockMajor),
    ];
    for (i, (p_tp, d_tp, p_bt, d_bt, order, placement)) in topologies.into_iter().enumerate() {
        let prompt = prompt(23 + 17 * i, i as u32);
        let want = one_engine(&model, &prompt, 15);
        let what = format!("P tp {p_tp} blocks of {p_bt} -> D tp {d_tp} blocks of {d_bt}, {order:?} {placement:?}");

        let mut p = Engine::new(p_tp, p_bt, order, placement);
        let p_blocks = blocks(&[7, 1, 9, 30, 2, 11][..prompt.len().div_ceil(p_bt as usize)]);
        let first = model.prefill(&prompt, 16, &mut p.kv(&p_blocks)).unwrap();
        assert_eq!(first.token, want[0], "{what}: P's first token");

        let mut d = Engine::new(d_tp, d_bt, order, placement);
        // D's blocks for the prompt, then one more for what it decodes.
        let d_blocks = blocks(&[5, 40, 0, 13, 8, 21]);
        let prompt_blocks = prompt.len().div_ceil(d_bt as usize);
        let moved = move_kv(&p, &p_blocks, &mut d, &d_blocks[..prompt_blocks]);
        assert!(moved > 0, "{what}");
        let decoded = model.decode(first.token, prompt.len(), 15, &mut d.kv(&d_blocks)).unwrap();
        assert_eq!([&[first.token][..], &decoded.tokens].concat(), want, "{what}: D's tokens");

        let mut zeroed = Engine::new(d_tp, d_bt, order, placement);
        let control = model.decode(first.token, prompt.len(), 15, &mut zeroed.kv(&d_blocks)).unwrap();
        assert_ne!(control.tokens, decoded.tokens, "{what}: tokens from zeroed KV");
    }
}

#[test]
fn every_tp_size_keeps_the_same_kv_bytes_and_gives_the_same_tokens() {
    let model = TinyLlama::from_seed(CONFIG, 7).unwrap();
    let prompt = prompt(50, 3);
    let ids = blocks(&[4, 2, 0, 6, 9]);
    let mut heads_bytes = Vec::new();
    for tp in [1, 2, 4, 8] {
        let mut engine = Engine::new(tp, 16, MemoryOrder::Hnd, Placement::BlockMajor);
        let first = model.prefill(&prompt, 16, &mut engine.kv(&ids)).unwrap();
        let tokens = model.decode(first.token, prompt.len(), 8, &mut engine.kv(&ids)).unwrap().tokens;
        // Every head's K and V at every position, read back: the same whatever the TP.
        let kv = engine.kv(&ids);
        let mut all = Vec::new();
        for layer in 0..CONFIG.layers {
            for plane in 0..2 {
                for head in 0..CONFIG.kv_heads {
                    for position in 0..prompt.len() + 8 {
                        let mut out = vec![0f32; CONFIG.head_dim];
                        kv_model::KvStore::read(&kv, layer, plane, head, position, &mut out).unwrap();
                        all.extend(out.iter().map(|v| v.to_bits()));
                    }
                }
            }
        }
        heads_bytes.push((tp, first.token, tokens, all));
    }
    for (tp, first, tokens, all) in &heads_bytes[1..] {
        assert_eq!((first, tokens), (&heads_bytes[0].1, &heads_bytes[0].2), "TP {tp}'s tokens");
        assert!(all == &heads_bytes[0].3, "TP {tp}'s KV differs from TP 1's");
    }
}

#[test]
fn prompts_decode_to_distinct_sequences_with_clear_greedy_choices() {
    let model = TinyLlama::from_seed(CONFIG, 7).unwrap();
    let mut sequences = std::collections::BTreeSet::new();
    let mut min_margin = f32::INFINITY;
    for i in 0..20 {
        let generated = model.generate_alone(&prompt(5 + 23 * i, i as u32), 16, 15, 16).unwrap();
        min_margin = min_margin.min(generated.min_margin);
        sequences.insert(generated.tokens);
    }
    println!("distinct sequences {} of 20, smallest top-1 margin {min_margin}", sequences.len());
    assert!(sequences.len() >= 18, "{} distinct sequences of 20", sequences.len());
    assert!(min_margin > 1e-3, "a greedy choice {min_margin} ahead of the next");
}

#[test]
fn a_prefill_steps_chunk_by_chunk_to_the_same_first_token() {
    let model = TinyLlama::from_seed(CONFIG, 7).unwrap();
    let prompt = prompt(70, 4);
    let mut engine = Engine::new(1, 16, MemoryOrder::Hnd, Placement::BlockMajor);
    let ids = blocks(&(0..8).collect::<Vec<_>>());
    let mut kv = engine.kv(&ids);
    let mut run = model.start_prefill(&prompt, 32).unwrap();
    let mut computed = Vec::new();
    let first = loop {
        let step = run.step(&mut kv).unwrap();
        computed.push(run.computed());
        if let Some(first) = step {
            break first;
        }
    };
    assert_eq!(computed, [32, 64, 70]);
    let alone = model.generate_alone(&prompt, 32, 0, 16).unwrap();
    assert_eq!((vec![first.token], first.margin), (alone.tokens, alone.min_margin));
}

#[test]
fn what_the_model_cannot_take_is_an_error_naming_it() {
    let model = TinyLlama::from_seed(CONFIG, 7).unwrap();
    let mut engine = Engine::new(1, 16, MemoryOrder::Hnd, Placement::BlockMajor);
    let ids = blocks(&[0]);
    let mut kv = engine.kv(&ids);
    let err = model.forward(&[4096], 0, &mut kv).unwrap_err();
    assert!(matches!(err, ModelError::Input(_)) && err.to_string().contains("token 4096"), "{err}");
    let err = model.prefill(&prompt(17, 0), 16, &mut kv).unwrap_err();
    assert!(err.to_string().contains("position 16 is past the sequence's 1 blocks of 16 tokens"), "{err}");
    let f16 = kv_core::KvLayout {
        dtype: kv_core::Dtype::Float16,
        ..CONFIG.kv_layout(16, MemoryOrder::Hnd, Placement::BlockMajor)
    };
    let shape = PoolShape::new(f16, 4, 1).unwrap();
    let mut memory = vec![0u8; shape.pool_bytes() as usize];
    let refused = PoolKv::new(vec![RankMemory { shape, regions: vec![&mut memory[..]] }], &ids);
    assert!(refused.err().is_some_and(|e| e.to_string().contains("f32 K/V-split")));
}

#[test]
fn kv_behind_the_memory_port_decodes_as_one_engine_does() {
    let model = TinyLlama::from_seed(CONFIG, 7).unwrap();
    let prompt = prompt(40, 9);
    let want = one_engine(&model, &prompt, 15);
    // TP 2, each rank's layer-major pool in one host allocation, its regions one after another.
    let mut memory = kv_cuda::CudaMemory::new();
    let layout = CONFIG.kv_layout(16, MemoryOrder::Nhd, Placement::LayerMajor);
    let ranks: Vec<RankRegions> = (0..2)
        .map(|_| {
            let shape = PoolShape::new(layout, layout.heads_per_rank(2), BLOCKS).unwrap();
            let region = memory.allocate(MemoryKind::Host, shape.pool_bytes()).unwrap();
            let regions = (0..u64::from(shape.region_count())).map(|i| (region.id, i * shape.region_len())).collect();
            RankRegions { shape, regions }
        })
        .collect();
    let ids = blocks(&[3, 8, 1, 12, 6]);
    let mut kv = PoolKv::in_memory(&mut memory, ranks, &ids).unwrap();
    let first = model.prefill(&prompt, 16, &mut kv).unwrap();
    let rest = model.decode(first.token, prompt.len(), 15, &mut kv).unwrap();
    assert_eq!([&[first.token][..], &rest.tokens].concat(), want);

    let shape = PoolShape::new(layout, 4, BLOCKS).unwrap();
    let wrong = vec![RankRegions { shape, regions: vec![] }];
    let refused = PoolKv::in_memory(&mut memory, wrong, &ids).err().expect("a rank naming no regions");
    assert!(refused.to_string().contains("names 0 regions, its pool shape has 4"), "{refused}");
}

#[test]
fn a_prefix_computed_alone_holds_the_kv_a_longer_prompt_computed_for_it() {
    // D's own prefix cache in a partial prefix hit: the prompt's first 48 tokens computed
    // alone (one chunk of 48), against the whole prompt of 100 in chunks of 64 and of 16
    // (48 tokens inside the first chunk, or three whole ones); and the fingerprint of the same
    // KV at TP 2 in another layout.
    let model = TinyLlama::from_seed(CONFIG, 7).unwrap();
    let prompt = prompt(100, 3);
    let ids = blocks(&(0..8).collect::<Vec<_>>());
    let mut whole = Engine::new(1, 16, MemoryOrder::Hnd, Placement::BlockMajor);
    let mut kv = whole.kv(&ids);
    model.prefill(&prompt, 64, &mut kv).unwrap();
    let want = model.kv_fingerprint(&kv, 48).unwrap();
    let mut sixteens = Engine::new(1, 16, MemoryOrder::Hnd, Placement::BlockMajor);
    model.prefill(&prompt, 16, &mut sixteens.kv(&ids)).unwrap();
    assert_eq!(model.kv_fingerprint(&sixteens.kv(&ids), 100).unwrap(), model.kv_fingerprint(&kv, 100).unwrap());
    assert_ne!(want, model.kv_fingerprint(&kv, 47).unwrap(), "a position more changes the fingerprint");
    let mut prefix = Engine::new(2, 32, MemoryOrder::Nhd, Placement::LayerMajor);
    let mut kv = prefix.kv(&ids);
    model.prefill(&prompt[..48], 64, &mut kv).unwrap();
    assert_eq!(model.kv_fingerprint(&kv, 48).unwrap(), want);
    let alone = model.generate_alone(&prompt, 64, 3, 16).unwrap();
    assert_eq!(alone.kv_fingerprint, model.kv_fingerprint(&whole.kv(&ids), 100).unwrap());
    model.zero_kv(&mut kv, 48).unwrap();
    assert_ne!(model.kv_fingerprint(&kv, 48).unwrap(), want, "zeroed KV");
}

/// Layer by layer: each layer's K and V of a chunk are all in the store when the model says
/// the layer is stored, and none is written after, so an engine may send them on at once;
/// and the logits are `forward`'s.
#[test]
fn a_layer_said_stored_is_never_written_again() {
    use std::cell::RefCell;

    /// A store that logs the layer of each write.
    struct Logged<'a, 'k> {
        inner: &'a mut PoolKv<'k>,
        log: &'a RefCell<Vec<(char, usize)>>,
    }
    impl kv_model::KvStore for Logged<'_, '_> {
        fn write(
            &mut self,
            layer: usize,
            plane: usize,
            head: usize,
            position: usize,
            values: &[f32],
        ) -> Result<(), ModelError> {
            self.log.borrow_mut().push(('w', layer));
            self.inner.write(layer, plane, head, position, values)
        }
        fn read(
            &self,
            layer: usize,
            plane: usize,
            head: usize,
            position: usize,
            out: &mut [f32],
        ) -> Result<(), ModelError> {
            self.inner.read(layer, plane, head, position, out)
        }
    }

    let model = TinyLlama::from_seed(CONFIG, 7).unwrap();
    let prompt = prompt(40, 2);
    let ids = blocks(&(0..4).collect::<Vec<_>>());
    let mut engine = Engine::new(1, 16, MemoryOrder::Hnd, Placement::BlockMajor);
    let log = RefCell::new(Vec::new());
    let logits = {
        let mut kv = engine.kv(&ids);
        let mut logged = Logged { inner: &mut kv, log: &log };
        model.forward_layers(&prompt, 0, &mut logged, &mut |l| log.borrow_mut().push(('s', l))).unwrap()
    };
    let log = log.into_inner();
    let stored: Vec<usize> = log.iter().filter(|(what, _)| *what == 's').map(|&(_, l)| l).collect();
    assert_eq!(stored, (0..CONFIG.layers).collect::<Vec<_>>(), "each layer said stored once, in order");
    for (i, &(what, layer)) in log.iter().enumerate() {
        if what == 'w' {
            assert!(!log[..i].contains(&('s', layer)), "layer {layer} written after it was said stored");
        } else {
            assert!(log[..i].contains(&('w', layer)), "layer {layer} said stored before any write");
        }
    }
    let mut again = Engine::new(1, 16, MemoryOrder::Hnd, Placement::BlockMajor);
    assert_eq!(model.forward(&prompt, 0, &mut again.kv(&ids)).unwrap(), logits);
}
