//! The transformer: Llama's architecture (grouped-query attention, rotary position embeddings
//! in the rotate-half form, RMSNorm, a SwiGLU MLP, an untied output head), f32 on the CPU with
//! candle, its KV read from and written to a [`KvStore`] at every layer.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use kv_core::{Dtype, Fnv1a, KvLayout, MemoryOrder, Placement};

use crate::kv::KvStore;
use crate::ModelError;

/// A model's dimensions.
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct ModelConfig {
    /// Transformer layers.
    pub layers: usize,
    /// The residual stream's width.
    pub hidden: usize,
    /// Query heads.
    pub heads: usize,
    /// KV heads (each serves `heads / kv_heads` query heads).
    pub kv_heads: usize,
    /// Elements a head.
    pub head_dim: usize,
    /// The MLP's inner width.
    pub intermediate: usize,
    /// Tokens in the vocabulary.
    pub vocab: usize,
    /// RoPE's base.
    pub rope_theta: f32,
    /// RMSNorm's epsilon.
    pub rms_eps: f32,
    /// The longest sequence (RoPE's table).
    pub max_positions: usize,
}

impl ModelConfig {
    /// tiny-llama: 4 layers, hidden 256, 8 query heads, 4 KV heads of 32, vocabulary 4096.
    pub const TINY_LLAMA: ModelConfig = ModelConfig {
        layers: 4,
        hidden: 256,
        heads: 8,
        kv_heads: 4,
        head_dim: 32,
        intermediate: 512,
        vocab: 4096,
        rope_theta: 10_000.0,
        rms_eps: 1e-5,
        max_positions: 4096,
    };

    /// The KV layout of the model's cache in an engine of `block_tokens`-token blocks: f32,
    /// K and V planes, in `order` and `placement`.
    pub fn kv_layout(&self, block_tokens: u32, order: MemoryOrder, placement: Placement) -> KvLayout {
        KvLayout {
            order,
            placement,
            ..KvLayout::split_kv(
                self.layers as u32,
                block_tokens,
                self.kv_heads as u32,
                self.head_dim as u32,
                Dtype::Float32,
            )
        }
    }
}

/// Attention's positions are padded to a multiple of this (see [`TinyLlama::forward`]).
const ATTENTION_SPAN: usize = 64;

/// One layer's weights: linear weights `(out, in)` as Hugging Face stores them, and their
/// transposes, contiguous, for the matmuls.
struct Layer {
    input_norm: Tensor,
    post_norm: Tensor,
    /// q, k, v, o, gate, up, down: `(weight, transposed)`.
    linear: [(Tensor, Tensor); 7],
}

const LINEAR: [&str; 7] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
];

/// A Llama-architecture model whose weights are drawn from a seed.
pub struct TinyLlama {
    config: ModelConfig,
    device: Device,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: (Tensor, Tensor),
    cos: Tensor,
    sin: Tensor,
    /// The KV head each query head reads (Hugging Face's `repeat_kv`: each KV head serves
    /// `heads / kv_heads` consecutive query heads).
    kv_of_head: Tensor,
}

/// splitmix64: the weights' random stream, seeded per tensor.
struct Stream(u64);

impl Stream {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A standard normal draw (Box-Muller).
    fn normal(&mut self) -> f32 {
        let u1 = ((self.next() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
        let u2 = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }
}

/// The seed of tensor `name` of the model drawn from `seed` (FNV-1a of the name).
fn tensor_seed(seed: u64, name: &str) -> u64 {
    Fnv1a::from_state(Fnv1a::OFFSET ^ seed).write(name.bytes()).finish()
}

impl TinyLlama {
    /// The model of `config` with weights drawn from `seed`: normal, scaled by one over the
    /// square root of each linear layer's input width (the embeddings unscaled, the output
    /// head four times wider, so that greedy choices are rarely near ties), norms of ones.
    pub fn from_seed(config: ModelConfig, seed: u64) -> Result<Self, ModelError> {
        let device = Device::Cpu;
        let c = config;
        let draw = |name: &str, rows: usize, cols: usize, scale: f32| -> Result<Tensor, ModelError> {
            let mut stream = Stream(tensor_seed(seed, name));
            let values: Vec<f32> = (0..rows * cols).map(|_| stream.normal() * scale).collect();
            Ok(Tensor::from_vec(values, (rows, cols), &device)?)
        };
        let linear = |name: &str, out: usize, inp: usize| -> Result<(Tensor, Tensor), ModelError> {
            let w = draw(name, out, inp, 1.0 / (inp as f32).sqrt())?;
            let t = w.t()?.contiguous()?;
            Ok((w, t))
        };
        let ones = |n: usize| Tensor::ones(n, DType::F32, &device);
        let (q, kv, hd) = (c.heads * c.head_dim, c.kv_heads * c.head_dim, c.head_dim);
        let mut layers = Vec::with_capacity(c.layers);
        for l in 0..c.layers {
            let name = |part: &str| format!("model.layers.{l}.{part}.weight");
            let shapes = [
                (q, c.hidden),
                (kv, c.hidden),
                (kv, c.hidden),
                (c.hidden, q),
                (c.intermediate, c.hidden),
                (c.intermediate, c.hidden),
                (c.hidden, c.intermediate),
            ];
            let mut made = Vec::with_capacity(7);
            for (part, (out, inp)) in LINEAR.iter().zip(shapes) {
                made.push(linear(&name(part), out, inp)?);
            }
            let linear: [(Tensor, Tensor); 7] =
                made.try_into().map_err(|_| ModelError::Kv("seven linear layers".into()))?;
            layers.push(Layer { input_norm: ones(c.hidden)?, post_norm: ones(c.hidden)?, linear });
        }
        let embed = draw("model.embed_tokens.weight", c.vocab, c.hidden, 1.0)?;
        let head = draw("lm_head.weight", c.vocab, c.hidden, 4.0 / (c.hidden as f32).sqrt())?;
        let lm_head = (head.clone(), head.t()?.contiguous()?);
        // RoPE's table as Hugging Face computes it, in f32.
        let half = hd / 2;
        let inv: Vec<f32> = (0..half).map(|i| 1.0 / c.rope_theta.powf((2 * i) as f32 / hd as f32)).collect();
        let angles: Vec<f32> = (0..c.max_positions).flat_map(|p| inv.iter().map(move |f| p as f32 * f)).collect();
        let cos =
            Tensor::from_vec(angles.iter().map(|a| a.cos()).collect::<Vec<_>>(), (c.max_positions, half), &device)?;
        let sin =
            Tensor::from_vec(angles.iter().map(|a| a.sin()).collect::<Vec<_>>(), (c.max_positions, half), &device)?;
        let group = c.heads / c.kv_heads;
        let kv_of_head =
            Tensor::from_vec((0..c.heads as u32).map(|h| h / group as u32).collect::<Vec<_>>(), c.heads, &device)?;
        let norm = ones(c.hidden)?;
        Ok(TinyLlama { config, device, embed, layers, norm, lm_head, cos, sin, kv_of_head })
    }

    /// The model's dimensions.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Runs `tokens` at positions `start ..`: writes their K and V into `kv` at every layer,
    /// attends over positions `0 ..= ` each one's own (read back from `kv`, so a sequence
    /// whose earlier KV another engine computed attends to exactly those bytes), and returns
    /// the logits after the last token.
    pub fn forward(&self, tokens: &[u32], start: usize, kv: &mut dyn KvStore) -> Result<Vec<f32>, ModelError> {
        self.forward_layers(tokens, start, kv, &mut |_| {})
    }

    /// As [`TinyLlama::forward`], calling `stored(l)` as soon as layer `l`'s K and V of these
    /// tokens are in `kv` (before the layer's attention and MLP): from then on they are final,
    /// and an engine that computes layer by layer can send them on while the rest computes.
    pub fn forward_layers(
        &self,
        tokens: &[u32],
        start: usize,
        kv: &mut dyn KvStore,
        stored: &mut dyn FnMut(usize),
    ) -> Result<Vec<f32>, ModelError> {
        let c = &self.config;
        let n = tokens.len();
        let total = start + n;
        if n == 0 || total > c.max_positions {
            return Err(ModelError::Input(format!(
                "{n} tokens from position {start}: the model runs 1 or more, up to position {}",
                c.max_positions
            )));
        }
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= c.vocab) {
            return Err(ModelError::Input(format!("token {bad} is outside the vocabulary of {}", c.vocab)));
        }
        let (heads, kvh, hd) = (c.heads, c.kv_heads, c.head_dim);
        let ids = Tensor::new(tokens, &self.device)?;
        let mut x = self.embed.index_select(&ids, 0)?;
        let cos = self.cos.narrow(0, start, n)?;
        let sin = self.sin.narrow(0, start, n)?;
        // Attention runs over `span` positions, `total` padded with masked zeros to a whole
        // number of `ATTENTION_SPAN`s: the sums over positions then have one shape whatever
        // chunk a position was computed in, so a prefix computed alone (an engine's own prefix
        // cache) holds the very bits a longer prompt's chunks computed for it.
        let span = total.next_multiple_of(ATTENTION_SPAN);
        let mask: Vec<f32> =
            (0..n).flat_map(|i| (0..span).map(move |j| if j <= start + i { 0.0 } else { f32::NEG_INFINITY })).collect();
        let mask = Tensor::from_vec(mask, (1, n, span), &self.device)?;
        let scale = 1.0 / (hd as f64).sqrt();
        for (l, layer) in self.layers.iter().enumerate() {
            let [q, k, v, o, gate, up, down] = &layer.linear;
            let h = candle_nn::ops::rms_norm(&x, &layer.input_norm, c.rms_eps)?;
            let heads_of = |w: &Tensor, count: usize| -> Result<Tensor, ModelError> {
                Ok(h.matmul(w)?.reshape((1, n, count, hd))?.transpose(1, 2)?.contiguous()?)
            };
            let q = candle_nn::rotary_emb::rope(&heads_of(&q.1, heads)?, &cos, &sin)?;
            let k = candle_nn::rotary_emb::rope(&heads_of(&k.1, kvh)?, &cos, &sin)?;
            let v = heads_of(&v.1, kvh)?;
            // This chunk's K and V into the store, then every position's back out of it.
            for (plane, t) in [k, v].iter().enumerate() {
                let values: Vec<f32> = t.flatten_all()?.to_vec1()?;
                for head in 0..kvh {
                    for i in 0..n {
                        let at = (head * n + i) * hd;
                        kv.write(l, plane, head, start + i, &values[at..at + hd])?;
                    }
                }
            }
            stored(l);
            let mut planes = Vec::with_capacity(2);
            for plane in 0..2 {
                let mut values = vec![0f32; kvh * span * hd];
                for head in 0..kvh {
                    for p in 0..total {
                        let at = (head * span + p) * hd;
                        kv.read(l, plane, head, p, &mut values[at..at + hd])?;
                    }
                }
                let t = Tensor::from_vec(values, (kvh, span, hd), &self.device)?;
                planes.push(t.index_select(&self.kv_of_head, 0)?);
            }
            let q = q.squeeze(0)?;
            let scores = q.matmul(&planes[0].t()?.contiguous()?)?.affine(scale, 0.0)?.broadcast_add(&mask)?;
            let attention = candle_nn::ops::softmax_last_dim(&scores)?.matmul(&planes[1])?;
            let attention = attention.transpose(0, 1)?.contiguous()?.reshape((n, heads * hd))?;
            x = (x + attention.matmul(&o.1)?)?;
            let h = candle_nn::ops::rms_norm(&x, &layer.post_norm, c.rms_eps)?;
            let mlp = (h.matmul(&gate.1)?.silu()? * h.matmul(&up.1)?)?.matmul(&down.1)?;
            x = (x + mlp)?;
        }
        let x = candle_nn::ops::rms_norm(&x, &self.norm, c.rms_eps)?;
        let logits = x.narrow(0, n - 1, 1)?.matmul(&self.lm_head.1)?;
        Ok(logits.flatten_all()?.to_vec1()?)
    }

    /// Computes `prompt` into `kv` in chunks of `chunk` tokens (as a prefill engine does) and
    /// picks the first generated token: the greedy choice and its margin over the runner-up.
    pub fn prefill(&self, prompt: &[u32], chunk: usize, kv: &mut dyn KvStore) -> Result<Choice, ModelError> {
        let mut run = self.start_prefill(prompt, chunk)?;
        loop {
            if let Some(first) = run.step(kv)? {
                return Ok(first);
            }
        }
    }

    /// A prefill of `prompt` in chunks of `chunk` tokens, run one chunk at a time
    /// ([`Prefill::step`]), so that an engine can say which blocks are computed as each chunk
    /// ends (push writes them ahead).
    pub fn start_prefill<'m>(&'m self, prompt: &[u32], chunk: usize) -> Result<Prefill<'m>, ModelError> {
        if prompt.is_empty() || chunk == 0 {
            return Err(ModelError::Input(format!("a prompt of {} tokens in chunks of {chunk}", prompt.len())));
        }
        Ok(Prefill { model: self, prompt: prompt.to_vec(), chunk, computed: 0 })
    }

    /// One engine alone, as the reference a disaggregated run must equal: `prompt` computed in
    /// chunks of `chunk` into a pool of its own (TP 1, blocks of `block_tokens`), then `count`
    /// tokens decoded after the first; all `count + 1` tokens, with the smallest margin, the
    /// fingerprint of the prompt's KV ([`TinyLlama::kv_fingerprint`]) and how long the prefill
    /// and the decode took.
    pub fn generate_alone(
        &self,
        prompt: &[u32],
        chunk: usize,
        count: usize,
        block_tokens: u32,
    ) -> Result<Alone, ModelError> {
        let layout = self.config.kv_layout(block_tokens, MemoryOrder::Hnd, Placement::BlockMajor);
        let blocks = (prompt.len() + count).div_ceil(block_tokens.max(1) as usize) as u32;
        let shape = kv_core::PoolShape::new(layout, layout.heads_per_rank(1), blocks)
            .map_err(|e| ModelError::Kv(format!("a pool of {blocks} blocks: {e}")))?;
        let mut pool = vec![0u8; shape.pool_bytes() as usize];
        let ids: Vec<kv_core::BlockId> = (0..blocks).map(kv_core::BlockId).collect();
        let mut kv = crate::PoolKv::new(vec![crate::RankMemory { shape, regions: vec![&mut pool[..]] }], &ids)?;
        let started = Instant::now();
        let first = self.prefill(prompt, chunk, &mut kv)?;
        let prefill = started.elapsed();
        let kv_fingerprint = self.kv_fingerprint(&kv, prompt.len())?;
        let started = Instant::now();
        let rest = self.decode(first.token, prompt.len(), count, &mut kv)?;
        let decode = started.elapsed();
        let tokens = [&[first.token][..], &rest.tokens].concat();
        Ok(Alone { tokens, min_margin: first.margin.min(rest.min_margin), kv_fingerprint, prefill, decode })
    }

    /// A fingerprint of the KV of a sequence's first `positions` tokens in `kv`: FNV-1a (64
    /// bits) over every value's bits, layer by layer, K then V, head by head, position by
    /// position; equal KV gives equal fingerprints whatever pools, TP size or layout hold it.
    pub fn kv_fingerprint(&self, kv: &dyn KvStore, positions: usize) -> Result<u64, ModelError> {
        let mut values = vec![0f32; self.config.head_dim];
        let mut hash = Fnv1a::new();
        for (layer, plane, head, position) in self.kv_rows(positions) {
            kv.read(layer, plane, head, position, &mut values)?;
            hash.write(values.iter().flat_map(|v| v.to_le_bytes()));
        }
        Ok(hash.finish())
    }

    /// Writes zeros over the KV of a sequence's first `positions` tokens in `kv` (a control:
    /// decoding from it must not give the tokens the real KV gives).
    pub fn zero_kv(&self, kv: &mut dyn KvStore, positions: usize) -> Result<(), ModelError> {
        let zeros = vec![0f32; self.config.head_dim];
        for (layer, plane, head, position) in self.kv_rows(positions) {
            kv.write(layer, plane, head, position, &zeros)?;
        }
        Ok(())
    }

    /// Every (layer, plane, KV head, position) of a sequence's first `positions` tokens:
    /// layer by layer, K then V, head by head, position by position.
    fn kv_rows(&self, positions: usize) -> impl Iterator<Item = (usize, usize, usize, usize)> {
        let (layers, heads) = (self.config.layers, self.config.kv_heads);
        (0..layers).flat_map(move |layer| {
            (0..2).flat_map(move |plane| {
                (0..heads).flat_map(move |head| (0..positions).map(move |position| (layer, plane, head, position)))
            })
        })
    }

    /// Decodes greedily after `first`, the token at `position` (the prompt's length), `count`
    /// more tokens, each from the KV in `kv` and the tokens before it; returns them with the
    /// smallest margin seen.
    pub fn decode(
        &self,
        first: u32,
        position: usize,
        count: usize,
        kv: &mut dyn KvStore,
    ) -> Result<Decoded, ModelError> {
        let (mut tokens, mut last, mut min_margin) = (Vec::with_capacity(count), first, f32::INFINITY);
        for i in 0..count {
            let choice = Choice::greedy(&self.forward(&[last], position + i, kv)?);
            min_margin = min_margin.min(choice.margin);
            tokens.push(choice.token);
            last = choice.token;
        }
        Ok(Decoded { tokens, min_margin })
    }

    /// Writes the model as Hugging Face's `LlamaForCausalLM` loads it: `config.json` and
    /// `model.safetensors`, with transformers' tensor names, into `dir`.
    pub fn save_hf(&self, dir: &Path) -> Result<(), ModelError> {
        let c = &self.config;
        std::fs::create_dir_all(dir).map_err(|e| ModelError::Save(format!("{}: {e}", dir.display())))?;
        let config = serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": c.hidden,
            "intermediate_size": c.intermediate,
            "num_hidden_layers": c.layers,
            "num_attention_heads": c.heads,
            "num_key_value_heads": c.kv_heads,
            "head_dim": c.head_dim,
            "vocab_size": c.vocab,
            "max_position_embeddings": c.max_positions,
            "rms_norm_eps": c.rms_eps,
            "rope_theta": c.rope_theta,
            "hidden_act": "silu",
            "attention_bias": false,
            "mlp_bias": false,
            "tie_word_embeddings": false,
            "torch_dtype": "float32",
            "bos_token_id": 0,
            "eos_token_id": 1,
        });
        let text = serde_json::to_string_pretty(&config).map_err(|e| ModelError::Save(e.to_string()))?;
        std::fs::write(dir.join("config.json"), text).map_err(|e| ModelError::Save(format!("config.json: {e}")))?;
        let mut tensors: HashMap<String, Tensor> = HashMap::new();
        tensors.insert("model.embed_tokens.weight".into(), self.embed.clone());
        tensors.insert("model.norm.weight".into(), self.norm.clone());
        tensors.insert("lm_head.weight".into(), self.lm_head.0.clone());
        for (l, layer) in self.layers.iter().enumerate() {
            tensors.insert(format!("model.layers.{l}.input_layernorm.weight"), layer.input_norm.clone());
            tensors.insert(format!("model.layers.{l}.post_attention_layernorm.weight"), layer.post_norm.clone());
            for (part, (w, _)) in LINEAR.iter().zip(&layer.linear) {
                tensors.insert(format!("model.layers.{l}.{part}.weight"), w.clone());
            }
        }
        candle_core::safetensors::save(&tensors, dir.join("model.safetensors"))?;
        Ok(())
    }
}

/// A prompt's prefill, one chunk at a time.
pub struct Prefill<'m> {
    model: &'m TinyLlama,
    prompt: Vec<u32>,
    chunk: usize,
    computed: usize,
}

impl Prefill<'_> {
    /// Computes the next chunk into `kv`; after the last, the first generated token.
    pub fn step(&mut self, kv: &mut dyn KvStore) -> Result<Option<Choice>, ModelError> {
        let end = (self.computed + self.chunk).min(self.prompt.len());
        let logits = self.model.forward(&self.prompt[self.computed..end], self.computed, kv)?;
        self.computed = end;
        Ok((end == self.prompt.len()).then(|| Choice::greedy(&logits)))
    }

    /// Prompt tokens computed so far.
    pub fn computed(&self) -> usize {
        self.computed
    }
}

/// A greedy choice: the token with the highest logit and its lead over the next.
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct Choice {
    /// The token.
    pub token: u32,
    /// Its logit less the runner-up's.
    pub margin: f32,
}

impl Choice {
    /// The greedy choice among `logits` (the lowest index among equals).
    pub fn greedy(logits: &[f32]) -> Self {
        let (mut best, mut second) = ((0usize, f32::NEG_INFINITY), f32::NEG_INFINITY);
        for (i, &logit) in logits.iter().enumerate() {
            if logit > best.1 {
                second = best.1;
                best = (i, logit);
            } else if logit > second {
                second = logit;
            }
        }
        Choice { token: best.0 as u32, margin: best.1 - second }
    }
}

/// Tokens decoded greedily, and the smallest margin among their choices.
#[derive(Clone, PartialEq, Debug)]
pub struct Decoded {
    /// The tokens, in order.
    pub tokens: Vec<u32>,
    /// The smallest lead of a chosen token over the runner-up.
    pub min_margin: f32,
}

/// One engine's run of a prompt ([`TinyLlama::generate_alone`]).
#[derive(Clone, PartialEq, Debug)]
pub struct Alone {
    /// The first token and those decoded after it.
    pub tokens: Vec<u32>,
    /// The smallest lead of a chosen token over the runner-up.
    pub min_margin: f32,
    /// [`TinyLlama::kv_fingerprint`] of the prompt's KV.
    pub kv_fingerprint: u64,
    /// The prefill's time (to the first token).
    pub prefill: Duration,
    /// The decode's time (every token after the first).
    pub decode: Duration,
}
