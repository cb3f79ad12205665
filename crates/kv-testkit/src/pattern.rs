//! The bytes the demo's P engines compute for a prompt's KV, and D's check of them (kvflow-node's
//! payload work), and the scrub byte of freed blocks that the cluster's oracle uses too.
//!
//! Every row of the KV (one head of one token, K or V, of one layer) is filled with 64-bit
//! words mixed from a seed that names the request and its P engine, and from the row's layer,
//! plane (K, V, or MLA's one latent), model-wide head and prompt-wide token. A chunk of a pool
//! lists which heads and tokens its rows hold ([`Chunk`]), in the pool's memory order; P fills
//! its chunks and D checks its own, so a row that lands in the wrong head slice, sub-block,
//! layer or plane, from the wrong request, or read after P freed it (P scrubs freed blocks with
//! [`SCRUB`]), fails the check, whatever P's and D's block sizes and head splits.

use std::ops::Range;

use kv_core::MemoryOrder;

/// The byte engines scrub freed blocks with; no computed chunk is all scrub.
pub const SCRUB: u8 = 0xDB;

/// The seed of a prompt's KV: its P engine and request (siblings share their parent's).
pub fn seed(engine: &str, request: &str) -> u64 {
    kv_core::Fnv1a::new().write(engine.bytes()).write([0xff]).write(request.bytes()).finish()
}

fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// One (layer, block, plane) chunk of a pool: `heads` heads from `first_head` (model-wide) by
/// `tokens` tokens from `first_token` (prompt-wide), rows of `row_bytes`, in `order`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Chunk {
    /// The layer.
    pub layer: u32,
    /// K (0), V (1), or MLA's latent (0).
    pub plane: u32,
    /// The model-wide index of the chunk's first head.
    pub first_head: u32,
    /// Heads in the chunk.
    pub heads: u32,
    /// The prompt-wide index of the chunk's first token.
    pub first_token: u64,
    /// Tokens in the chunk (the engine's block size).
    pub tokens: u32,
    /// Bytes of one row: one head of one token.
    pub row_bytes: usize,
    /// Heads then tokens, or tokens then heads.
    pub order: MemoryOrder,
}

impl Chunk {
    /// Bytes of the whole chunk.
    pub fn bytes(&self) -> usize {
        self.heads as usize * self.tokens as usize * self.row_bytes
    }

    /// Each row's model-wide head, prompt-wide token, and bytes within the chunk.
    fn rows(&self) -> impl Iterator<Item = (u32, u64, Range<usize>)> + '_ {
        let (heads, tokens) = (self.heads as usize, self.tokens as usize);
        (0..heads * tokens).map(move |i| {
            let (h, t) = match self.order {
                MemoryOrder::Hnd => (i / tokens, i % tokens),
                MemoryOrder::Nhd => (i % heads, i / heads),
            };
            let head = self.first_head + h as u32;
            (head, self.first_token + t as u64, i * self.row_bytes..(i + 1) * self.row_bytes)
        })
    }

    /// The key every word of a row is mixed from.
    fn row_key(&self, seed: u64, head: u32, token: u64) -> u64 {
        let place = (u64::from(self.layer) << 40) ^ (u64::from(self.plane) << 36) ^ (u64::from(head) << 20);
        mix(seed ^ mix(place) ^ mix(token.wrapping_add(0x9e37_79b9_7f4a_7c15)))
    }
}

/// Fills `out` (a chunk's bytes) with what P computes for it.
pub fn fill(out: &mut [u8], seed: u64, chunk: &Chunk) {
    for (head, token, bytes) in chunk.rows() {
        let key = chunk.row_key(seed, head, token);
        for (i, word) in out[bytes].chunks_mut(8).enumerate() {
            word.copy_from_slice(&mix(key ^ i as u64).to_le_bytes()[..word.len()]);
        }
    }
}

/// Whether `got` (a chunk's bytes) holds what P computed, in every row of a token below
/// `valid_tokens` (the prompt's; D's last block may run past what P wrote).
pub fn check(got: &[u8], seed: u64, chunk: &Chunk, valid_tokens: u64) -> bool {
    chunk.rows().filter(|&(_, token, _)| token < valid_tokens).all(|(head, token, bytes)| {
        let key = chunk.row_key(seed, head, token);
        got[bytes].chunks(8).enumerate().all(|(i, word)| word == &mix(key ^ i as u64).to_le_bytes()[..word.len()])
    })
}

/// Whether `got` holds only [`SCRUB`]. It compares 4 KiB at a time with `memcmp` rather than
/// byte by byte: D runs it on every freed block it allocates again, before its read, so it is
/// on the path the demo's latency measures.
pub fn is_scrub(got: &[u8]) -> bool {
    const LINE: [u8; 4096] = [SCRUB; 4096];
    got.chunks(LINE.len()).all(|c| c == &LINE[..c.len()])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(order: MemoryOrder) -> Chunk {
        Chunk { layer: 3, plane: 1, first_head: 4, heads: 2, first_token: 32, tokens: 16, row_bytes: 20, order }
    }

    #[test]
    fn a_filled_chunk_checks_and_nothing_else_does() {
        let s = seed("prefill0", "req-1");
        let c = chunk(MemoryOrder::Hnd);
        let mut bytes = vec![0u8; c.bytes()];
        fill(&mut bytes, s, &c);
        assert!(check(&bytes, s, &c, u64::MAX));
        for (other, what) in [
            (Chunk { layer: 4, ..c }, "another layer"),
            (Chunk { plane: 0, ..c }, "the other plane"),
            (Chunk { first_head: 5, ..c }, "another head slice"),
            (Chunk { first_token: 48, ..c }, "another block of the prompt"),
            (Chunk { order: MemoryOrder::Nhd, ..c }, "another memory order"),
        ] {
            assert!(!check(&bytes, s, &other, u64::MAX), "{what}");
        }
        assert!(!check(&bytes, seed("prefill0", "req-2"), &c, u64::MAX), "another request");
        assert!(!check(&vec![SCRUB; c.bytes()], s, &c, u64::MAX), "a scrubbed chunk");
        let last = c.bytes() - 1;
        bytes[last] ^= 1;
        assert!(!check(&bytes, s, &c, u64::MAX), "the last byte counts");
    }

    #[test]
    fn rows_past_the_prompt_are_not_checked_and_sub_blocks_line_up() {
        // P's 16-token blocks 2 and 3 are D's 32-token block 1: the same rows, by token.
        let s = seed("prefill0", "req-1");
        let d = Chunk { first_token: 32, tokens: 32, ..chunk(MemoryOrder::Hnd) };
        let mut got = vec![0u8; d.bytes()];
        for (i, head) in [4, 5].into_iter().enumerate() {
            for half in 0..2u64 {
                let p = Chunk { first_head: head, heads: 1, first_token: 32 + 16 * half, ..chunk(MemoryOrder::Hnd) };
                let at = i * 32 * 20 + half as usize * 16 * 20;
                fill(&mut got[at..at + p.bytes()], s, &p);
            }
        }
        assert!(check(&got, s, &d, u64::MAX), "a D block made of two P blocks and two head slices");
        // A prompt of 40 tokens: D's rows of tokens 40.. hold anything.
        for head in 0..2 {
            got[head * 32 * 20 + 8 * 20..head * 32 * 20 + 32 * 20].fill(0);
        }
        assert!(check(&got, s, &d, 40) && !check(&got, s, &d, 41));
    }

    #[test]
    fn only_all_scrub_is_scrub() {
        let mut chunk = vec![SCRUB; 10_000];
        assert!(is_scrub(&chunk));
        for at in [0, 4095, 4096, 9_999] {
            chunk[at] = 0;
            assert!(!is_scrub(&chunk), "a foreign byte at {at}");
            chunk[at] = SCRUB;
        }
    }
}
