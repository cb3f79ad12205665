//! `tiny_llama DIR [REQUESTS]`: writes tiny-llama (seed 7) into `DIR` as Hugging Face's
//! `LlamaForCausalLM` loads it, and prints, as one JSON object, `REQUESTS` (20 by default)
//! prompts of varied length and the 16 tokens one engine generates greedily for each, its
//! prompt computed in chunks of 16, so that transformers can check every token from outside.

use kv_model::{ModelConfig, TinyLlama};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = args.next().ok_or("usage: tiny_llama DIR [REQUESTS]")?;
    let requests: usize = args.next().map_or(Ok(20), |n| n.parse())?;
    let config = ModelConfig::TINY_LLAMA;
    let model = TinyLlama::from_seed(config, 7)?;
    model.save_hf(std::path::Path::new(&dir))?;
    let mut out = Vec::new();
    for i in 0..requests {
        let prompt: Vec<u32> =
            (0..5 + 23 * i as u32).map(|t| (t * 37 + i as u32 * 101 + 5) % config.vocab as u32).collect();
        let generated = model.generate_alone(&prompt, 16, 15, 16)?.tokens;
        out.push(serde_json::json!({ "prompt_ids": prompt, "generated_ids": generated }));
    }
    println!("{}", serde_json::json!({ "requests": out }));
    Ok(())
}
