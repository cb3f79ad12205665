//! The bytes P computes for a prompt block, and D's check of them.
//!
//! Each (layer, prompt block) chunk is filled with 64-bit words mixed from a seed that names
//! the request and its P engine, the layer, the block's position in the prompt, and the
//! word's offset. A block delivered to the wrong place, from the wrong request or layer, or
//! read after P freed it (P scrubs freed blocks with [`SCRUB`]) fails the check.

/// The byte engines scrub freed blocks with; no computed chunk is all scrub.
pub const SCRUB: u8 = 0xDB;

/// The seed of a prompt's KV: its P engine and request (siblings share their parent's).
pub fn seed(engine: &str, request: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in engine.bytes().chain([0xff]).chain(request.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

fn word(seed: u64, layer: u32, position: u32, index: usize) -> u64 {
    mix(seed ^ (u64::from(layer) << 48) ^ (u64::from(position) << 24) ^ index as u64)
}

/// Fills `out` with the bytes of prompt block `position` at `layer`.
pub fn fill(out: &mut [u8], seed: u64, layer: u32, position: u32) {
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let w = word(seed, layer, position, i).to_le_bytes();
        chunk.copy_from_slice(&w[..chunk.len()]);
    }
}

/// Whether `got` holds the bytes of prompt block `position` at `layer`.
pub fn check(got: &[u8], seed: u64, layer: u32, position: u32) -> bool {
    got.chunks(8).enumerate().all(|(i, chunk)| chunk == &word(seed, layer, position, i).to_le_bytes()[..chunk.len()])
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

    #[test]
    fn a_filled_chunk_checks_and_nothing_else_does() {
        let s = seed("prefill0", "req-1");
        let mut chunk = vec![0u8; 4100];
        fill(&mut chunk, s, 3, 7);
        assert!(check(&chunk, s, 3, 7));
        assert!(!check(&chunk, s, 3, 8), "another position");
        assert!(!check(&chunk, s, 4, 7), "another layer");
        assert!(!check(&chunk, seed("prefill0", "req-2"), 3, 7), "another request");
        assert!(!check(&chunk, seed("prefill1", "req-1"), 3, 7), "another engine");
        assert!(!check(&vec![SCRUB; 4100], s, 3, 7), "a scrubbed block");
        chunk[4099] ^= 1;
        assert!(!check(&chunk, s, 3, 7), "the last byte counts");
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
