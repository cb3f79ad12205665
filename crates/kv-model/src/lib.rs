//! tiny-llama: a small Llama-architecture transformer (grouped-query attention, RoPE, RMSNorm,
//! SwiGLU) on the CPU with candle, f32 throughout, whose KV cache lives in kvflow's pools.
//!
//! It exists so that an engine can show that the KV kvflow moved decodes token for token: P
//! computes a prompt into its pools ([`TinyLlama::prefill`], in chunks, as a prefill engine
//! does), kvflow moves the blocks, and D decodes from what landed in its own pools
//! ([`TinyLlama::decode`]); at any TP size, since the compute is not sharded: each KV head is
//! kept in, and read from, the pool of the rank that owns it ([`PoolKv`]), so D's tokens must
//! equal one engine's, bit for bit. The weights are drawn from a seed (nothing is downloaded;
//! this is not TinyLlama-1.1B), and [`TinyLlama::save_hf`] writes them as Hugging Face's
//! `LlamaForCausalLM` loads them, so that transformers can check the tokens from outside.
//!
//! ```
//! use kv_core::{BlockId, MemoryOrder, Placement, PoolShape};
//! use kv_model::{ModelConfig, PoolKv, RankMemory, TinyLlama};
//!
//! let config = ModelConfig::TINY_LLAMA;
//! let model = TinyLlama::from_seed(config, 7)?;
//! let layout = config.kv_layout(16, MemoryOrder::Hnd, Placement::BlockMajor);
//! let shape = PoolShape::new(layout, layout.heads_per_rank(1), 4)?;
//! let mut pool = vec![0u8; shape.pool_bytes() as usize];
//! let blocks = [BlockId(2), BlockId(0)];
//! let mut kv = PoolKv::new(vec![RankMemory { shape, regions: vec![&mut pool[..]] }], &blocks)?;
//! let first = model.prefill(&[5, 17, 300, 42], 2, &mut kv)?;
//! let next = model.decode(first.token, 4, 3, &mut kv)?;
//! assert_eq!(next.tokens.len(), 3);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod kv;
mod model;

pub use kv::{KvStore, PoolKv, RankMemory, RankRegions};
pub use model::{Alone, Choice, Decoded, ModelConfig, Prefill, TinyLlama};

/// What the model refuses or fails at.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A tensor operation failed.
    #[error("model: {0}")]
    Candle(#[from] candle_core::Error),
    /// The KV store cannot hold what the model reads or writes.
    #[error("kv store: {0}")]
    Kv(String),
    /// Input the model does not take.
    #[error("model input: {0}")]
    Input(String),
    /// Writing the model out failed.
    #[error("saving the model: {0}")]
    Save(String),
}
