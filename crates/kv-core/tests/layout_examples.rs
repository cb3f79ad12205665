//! Replays the worked examples of `docs/side-channel.md` ("Worked examples") against
//! [`PoolShape`], [`TpMapping`] and [`TransferPlan`], so that the byte ranges an outside peer
//! reads from the document are the ones kvflow reads.
//!
//! Each example names its engines (`model`, `prefill`, `decode`); the test builds both pools
//! from them, takes the D rank's read of the P rank from the TP mapping, plans it, and compares
//! the `read` and every `pair` line with the document. When they disagree it prints the block
//! as the code produces it, to paste over the document's after checking why.

use std::collections::BTreeMap;

use kv_core::{
    Attention, BlockId, Dtype, Granularity, Initiator, KvLayout, MemoryOrder, Placement, PlanInput, PoolShape,
    PoolSide, RegionBase, TpMapping, TransferPlan,
};

const FENCE: &str = "```examples";

/// The document's examples: each a list of `(key, value)` lines, in order.
fn read_examples() -> Vec<Vec<(String, String)>> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/side-channel.md");
    let text = std::fs::read_to_string(&path).expect("docs/side-channel.md");
    let start = text.find(FENCE).expect("docs/side-channel.md has an ```examples block") + FENCE.len();
    let block = &text[start..start + text[start..].find("```").expect("the examples block is closed")];
    let mut examples: Vec<Vec<(String, String)>> = Vec::new();
    for line in block.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let (key, value) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
        if key == "example" {
            examples.push(Vec::new());
        }
        let example = examples.last_mut().expect("an example begins with its `example` line");
        example.push((key.to_owned(), value.trim().to_owned()));
    }
    examples
}

/// `k=v` words of a line.
fn words(value: &str) -> BTreeMap<String, String> {
    value.split_whitespace().filter_map(|w| w.split_once('=')).map(|(k, v)| (k.to_owned(), v.to_owned())).collect()
}

fn number(words: &BTreeMap<String, String>, key: &str, default: u32) -> u32 {
    words.get(key).map_or(default, |v| v.parse().unwrap_or_else(|_| panic!("{key}={v} is not a number")))
}

fn blocks(words: &BTreeMap<String, String>) -> Vec<BlockId> {
    let list = words.get("blocks").expect("blocks=...");
    list.split(',').map(|b| BlockId(b.parse().expect("a block number"))).collect()
}

/// The model line, over the document's small default model.
fn layout(model: &BTreeMap<String, String>) -> KvLayout {
    let name = model.get("dtype").map_or("bfloat16", String::as_str);
    let dtype = *Dtype::ALL.iter().find(|d| d.name() == name).unwrap_or_else(|| panic!("dtype {name}"));
    let mut layout = KvLayout::split_kv(
        number(model, "layers", 2),
        16,
        number(model, "kv_heads", 8),
        number(model, "head_dim", 4),
        dtype,
    );
    layout.attention = match model.get("attention").map_or("SplitKv", String::as_str) {
        "Mla" => Attention::Mla,
        _ => Attention::SplitKv,
    };
    layout.order = match model.get("order").map_or("Hnd", String::as_str) {
        "Nhd" => MemoryOrder::Nhd,
        _ => MemoryOrder::Hnd,
    };
    layout.placement = match model.get("placement").map_or("BlockMajor", String::as_str) {
        "LayerMajor" => Placement::LayerMajor,
        "LayerPlaneMajor" => Placement::LayerPlaneMajor,
        _ => Placement::BlockMajor,
    };
    layout
}

/// One side's pool: its TP size, rank, block size, pipeline stage.
fn pool(layout: KvLayout, side: &BTreeMap<String, String>, num_blocks: u32) -> PoolShape {
    let (tp, rank) = (number(side, "tp", 1), number(side, "rank", 0));
    let layout = layout.with_block_tokens(number(side, "block_tokens", 16));
    let shape = PoolShape::new(layout, layout.heads_per_rank(tp), num_blocks).expect("a pool");
    shape.for_stage(number(side, "stage", 0), number(side, "pp", 1)).unwrap_or_else(|e| panic!("rank {rank}: {e}"))
}

/// The example's `read` and `pair` lines as the code makes them.
fn derive(example: &[(String, String)]) -> Vec<(String, String)> {
    let get = |key: &str| example.iter().find(|(k, _)| k == key).map(|(_, v)| words(v)).unwrap_or_default();
    let (model, p, d) = (get("model"), get("prefill"), get("decode"));
    let layout = layout(&model);
    let (p_blocks, d_blocks) = (blocks(&p), blocks(&d));
    let max_block = |b: &[BlockId]| b.iter().map(|b| b.0 + 1).max().unwrap_or(1);
    let p_shape = pool(layout, &p, max_block(&p_blocks));
    let d_shape = pool(layout, &d, max_block(&d_blocks));
    let tp =
        TpMapping::new(number(&p, "tp", 1), number(&d, "tp", 1), layout.kv_heads, layout.attention == Attention::Mla)
            .expect("a TP mapping");
    let plan = tp.decode_rank(number(&d, "rank", 0)).expect("the D rank");
    let p_rank = number(&p, "rank", 0) % number(&p, "tp", 1);
    let slice = *plan.reads.iter().find(|r| r.prefill_rank == p_rank).expect("the D rank reads this P rank");
    // Every region at address 0: the pairs then show offsets from each region's start.
    let regions =
        |shape: &PoolShape| vec![RegionBase { addr: 0, len: shape.region_len() }; shape.region_count() as usize];
    let (p_regions, d_regions) = (regions(&p_shape), regions(&d_shape));
    let input = PlanInput {
        prefill: PoolSide { shape: p_shape, regions: &p_regions, blocks: &p_blocks },
        decode: PoolSide { shape: d_shape, regions: &d_regions, blocks: &d_blocks },
        skip_tokens: number(&p, "skip_tokens", 0),
        slice,
        initiator: Initiator::Decode,
    };
    let built = TransferPlan::build(&input, Granularity::Merged).expect("a plan");
    let mut lines = vec![(
        "read".to_owned(),
        format!(
            "prefill_rank={} prefill_head={} decode_head={} heads={}",
            slice.prefill_rank, slice.prefill_head, slice.decode_head, slice.heads
        ),
    )];
    for pair in built.pairs() {
        lines.push((
            "pair".to_owned(),
            format!(
                "P {}/{:#x} +{:#x} -> D {}/{:#x}",
                pair.remote_region, pair.remote_addr, pair.len, pair.local_region, pair.local_addr
            ),
        ));
    }
    lines
}

#[test]
fn the_documented_reads_are_the_planned_ones() {
    let examples = read_examples();
    assert!(examples.len() >= 5, "the document has {} worked examples, expected at least 5", examples.len());
    let (mut wrong, mut produced) = (Vec::new(), String::new());
    for example in &examples {
        let inputs: Vec<(String, String)> =
            example.iter().filter(|(k, _)| !matches!(k.as_str(), "read" | "pair")).cloned().collect();
        let documented: Vec<(String, String)> =
            example.iter().filter(|(k, _)| matches!(k.as_str(), "read" | "pair")).cloned().collect();
        let derived = derive(&inputs);
        if derived != documented {
            wrong.push(inputs[0].1.clone());
        }
        for (key, value) in inputs.iter().chain(&derived) {
            produced.push_str(&format!("{key:<9} {value}\n"));
        }
        produced.push('\n');
    }
    assert!(
        wrong.is_empty(),
        "docs/side-channel.md's worked examples {wrong:?} disagree with the code, which plans:\n{produced}"
    );
}
