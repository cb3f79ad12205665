//! `tiny_llama DIR [REQUESTS]`: writes tiny-llama (seed 7) into `DIR` as Hugging Face's
//! `LlamaForCausalLM` loads it, and prints, as one JSON object, `REQUESTS` (20 by default)
//! prompts of varied length and the 16 tokens one engine generates greedily for each, its
//! prompt computed in chunks of 16, so that transformers can check every token from outside.

use kv_core::{BlockId, MemoryOrder, Placement, PoolShape};
use kv_model::{ModelConfig, PoolKv, RankMemory, TinyLlama};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = args.next().ok_or("usage: tiny_llama DIR [REQUESTS]")?;
    let requests: usize = args.next().map_or(Ok(20), |n| n.parse())?;
    let config = ModelConfig::TINY_LLAMA;
    let model = TinyLlama::from_seed(config, 7)?;
    model.save_hf(std::path::Path::new(&dir))?;
    let layout = config.kv_layout(16, MemoryOrder::Hnd, Placement::BlockMajor);
    let mut out = Vec::new();
    for i in 0..requests {
        let prompt: Vec<u32> =
            (0..5 + 23 * i as u32).map(|t| (t * 37 + i as u32 * 101 + 5) % config.vocab as u32).collect();
        let blocks: Vec<BlockId> = (0..(prompt.len() + 16).div_ceil(16) as u32).map(BlockId).collect();
        let shape = PoolShape::new(layout, layout.heads_per_rank(1), blocks.len() as u32)?;
        let mut pool = vec![0u8; shape.pool_bytes() as usize];
        let mut kv = PoolKv::new(vec![RankMemory { shape, regions: vec![&mut pool[..]] }], &blocks)?;
        let first = model.prefill(&prompt, 16, &mut kv)?;
        let rest = model.decode(first.token, prompt.len(), 15, &mut kv)?;
        let generated: Vec<u32> = [&[first.token][..], &rest.tokens].concat();
        out.push(serde_json::json!({ "prompt_ids": prompt, "generated_ids": generated }));
    }
    println!("{}", serde_json::json!({ "requests": out }));
    Ok(())
}
