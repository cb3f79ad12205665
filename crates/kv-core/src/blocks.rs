//! Block-size mapping, both ways, as vLLM's connector maps them: P's blocks may be a whole
//! multiple of D's or a whole fraction of them; sizes of which neither divides the other are
//! refused.
//!
//! The unit of a transfer is a *piece* of the smaller block size. With `d_block = m * p_block`,
//! D block `b` takes P blocks `b*m .. b*m + m - 1`, each into its `(i % m)`-th sub-block; with
//! `p_block = m * d_block`, D block `b` takes the `(b % m)`-th part of P block `b / m`. Pieces
//! pair in the prompt's order, clipped to the shorter side: D's last block may end past the
//! prompt (its tail stays untransferred), and P's last block may hold fewer tokens than a whole
//! block (its tail is read all the same, as whole blocks are, and D never uses it).

use std::ops::Range;

use crate::id::BlockId;
use crate::layout::KvLayout;

/// A block-size pairing kvflow refuses.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum BlockSizeError {
    /// A block size is zero.
    #[error("block size is 0 (prefill {prefill_tokens} tokens, decode {decode_tokens} tokens)")]
    Zero {
        /// P's tokens per block.
        prefill_tokens: u32,
        /// D's tokens per block.
        decode_tokens: u32,
    },
    /// The layout moves whole blocks only (fused K/V), and the sizes differ.
    #[error(
        "block size mismatch: a FusedKv layout moves whole blocks only, and the prefill block holds {prefill_tokens} tokens, the decode block {decode_tokens}"
    )]
    WholeBlocksOnly {
        /// P's tokens per block.
        prefill_tokens: u32,
        /// D's tokens per block.
        decode_tokens: u32,
    },
    /// Neither block size is a whole multiple of the other.
    #[error(
        "block size mismatch: neither the prefill block of {prefill_tokens} tokens nor the decode block of {decode_tokens} tokens is a multiple of the other"
    )]
    NotMultiple {
        /// P's tokens per block.
        prefill_tokens: u32,
        /// D's tokens per block.
        decode_tokens: u32,
    },
    /// D's blocks cannot hold what P's blocks are to move.
    #[error(
        "{decode_blocks} decode blocks of {decode_tokens} tokens cannot hold {prefill_tokens} tokens of prefill blocks"
    )]
    TooFewDecodeBlocks {
        /// D blocks given.
        decode_blocks: usize,
        /// D's tokens per block.
        decode_tokens: u32,
        /// Tokens of the P blocks given (less those skipped in the first).
        prefill_tokens: u64,
    },
    /// The tokens skipped in P's first block do not start a piece inside it.
    #[error("cannot skip {skip_tokens} tokens of a prefill block of {prefill_tokens} tokens in pieces of {piece_tokens} tokens")]
    Skip {
        /// Tokens to skip.
        skip_tokens: u32,
        /// P's tokens per block.
        prefill_tokens: u32,
        /// Tokens of a piece.
        piece_tokens: u32,
    },
    /// P's blocks do not hold every D block given.
    #[error("{decode_blocks} decode blocks of {decode_tokens} tokens need more than {prefill_tokens} tokens of prefill blocks")]
    TooFewPrefillBlocks {
        /// D blocks given.
        decode_blocks: usize,
        /// D's tokens per block.
        decode_tokens: u32,
        /// Tokens of the P blocks given (less those skipped in the first).
        prefill_tokens: u64,
    },
}

/// A validated pairing of P's and D's block sizes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct BlockSizeMapping {
    prefill_tokens: u32,
    decode_tokens: u32,
}

/// One piece of a transfer, of [`BlockSizeMapping::piece_tokens`] tokens: where it lies in
/// P's block and in D's.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Piece {
    /// Its position in the P blocks given.
    pub prefill_index: usize,
    /// The P block.
    pub prefill_block: BlockId,
    /// Its first token within the P block.
    pub prefill_token: u32,
    /// The D block.
    pub decode_block: BlockId,
    /// Its first token within the D block.
    pub decode_token: u32,
}

/// The P blocks that hold a run of D blocks: positions in the prompt's P blocks, and the
/// tokens of the first of them before the run.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct PrefillSpan {
    /// Positions of P's blocks, in the prompt.
    pub blocks: Range<usize>,
    /// Tokens of the first P block that precede the run (a part of a larger P block).
    pub skip_tokens: u32,
}

impl BlockSizeMapping {
    /// Pairs P blocks of `prefill_tokens` with D blocks of `decode_tokens`.
    pub fn new(prefill_tokens: u32, decode_tokens: u32) -> Result<Self, BlockSizeError> {
        if prefill_tokens == 0 || decode_tokens == 0 {
            return Err(BlockSizeError::Zero { prefill_tokens, decode_tokens });
        }
        if decode_tokens % prefill_tokens != 0 && prefill_tokens % decode_tokens != 0 {
            return Err(BlockSizeError::NotMultiple { prefill_tokens, decode_tokens });
        }
        Ok(BlockSizeMapping { prefill_tokens, decode_tokens })
    }

    /// [`BlockSizeMapping::new`] for P's `layout` and D's `decode_tokens` a block, refusing
    /// sizes that differ where the layout moves whole blocks only
    /// ([`KvLayout::whole_blocks_only`]).
    pub fn for_layout(layout: &KvLayout, decode_tokens: u32) -> Result<Self, BlockSizeError> {
        let prefill_tokens = layout.block_tokens;
        if layout.whole_blocks_only() && prefill_tokens != decode_tokens {
            return Err(BlockSizeError::WholeBlocksOnly { prefill_tokens, decode_tokens });
        }
        BlockSizeMapping::new(prefill_tokens, decode_tokens)
    }

    /// P's tokens per block.
    pub fn prefill_tokens(&self) -> u32 {
        self.prefill_tokens
    }

    /// D's tokens per block.
    pub fn decode_tokens(&self) -> u32 {
        self.decode_tokens
    }

    /// Tokens of a piece: the smaller block size.
    pub fn piece_tokens(&self) -> u32 {
        self.prefill_tokens.min(self.decode_tokens)
    }

    /// D blocks whose every token P's first `prefill_blocks` blocks hold: what a chunked
    /// prefill that finished those blocks can write ahead.
    pub fn decode_blocks_in(&self, prefill_blocks: usize) -> usize {
        let tokens = prefill_blocks as u64 * u64::from(self.prefill_tokens);
        (tokens / u64::from(self.decode_tokens)) as usize
    }

    /// The P blocks that hold the prompt's D blocks `decode` (positions in the prompt), with
    /// the tokens of the first before them; the end is not clipped to the prompt.
    pub fn prefill_span(&self, decode: Range<usize>) -> PrefillSpan {
        let (p, d) = (self.prefill_tokens as usize, self.decode_tokens as usize);
        let (start, end) = (decode.start * d, decode.end * d);
        PrefillSpan { blocks: start / p..end.div_ceil(p), skip_tokens: (start % p) as u32 }
    }

    /// The pieces that move `prefill` (P's blocks, from `skip_tokens` into the first) into
    /// `decode` (D's blocks), in order, clipped to the shorter side; an error if D's blocks
    /// cannot hold all of P's, or if P's do not reach into every D block.
    pub fn pieces(
        &self,
        prefill: &[BlockId],
        skip_tokens: u32,
        decode: &[BlockId],
    ) -> Result<Vec<Piece>, BlockSizeError> {
        let (p, d, g) = (u64::from(self.prefill_tokens), u64::from(self.decode_tokens), u64::from(self.piece_tokens()));
        if skip_tokens >= self.prefill_tokens || u64::from(skip_tokens) % g != 0 {
            let (prefill_tokens, piece_tokens) = (self.prefill_tokens, self.piece_tokens());
            return Err(BlockSizeError::Skip { skip_tokens, prefill_tokens, piece_tokens });
        }
        let prefill_tokens = (prefill.len() as u64 * p).saturating_sub(u64::from(skip_tokens));
        let decode_tokens = decode.len() as u64 * d;
        // P smaller: each P block is a piece, and all must land. P larger: each D block is a
        // piece, and each must be there in P (the prompt's last P block may be part-full).
        if self.prefill_tokens <= self.decode_tokens && prefill_tokens > decode_tokens {
            let (decode_blocks, decode_tokens) = (decode.len(), self.decode_tokens);
            return Err(BlockSizeError::TooFewDecodeBlocks { decode_blocks, decode_tokens, prefill_tokens });
        }
        // P's must reach into every D block: a D block past them would hold no KV, and the
        // engine would decode from it. (P smaller: the prompt's last D block may be part-full;
        // P larger: each D block must be there whole.)
        let reach =
            if self.prefill_tokens <= self.decode_tokens { decode_tokens.saturating_sub(d) + 1 } else { decode_tokens };
        if prefill_tokens < reach {
            let (decode_blocks, decode_tokens) = (decode.len(), self.decode_tokens);
            return Err(BlockSizeError::TooFewPrefillBlocks { decode_blocks, decode_tokens, prefill_tokens });
        }
        let pieces = prefill_tokens.min(decode_tokens) / g;
        Ok((0..pieces)
            .map(|i| {
                let (pt, dt) = (u64::from(skip_tokens) + i * g, i * g);
                let prefill_index = (pt / p) as usize;
                Piece {
                    prefill_index,
                    prefill_block: prefill[prefill_index],
                    prefill_token: (pt % p) as u32,
                    decode_block: decode[(dt / d) as usize],
                    decode_token: (dt % d) as u32,
                }
            })
            .collect())
    }
}

/// Blocks of `block_tokens` that a prompt of `prompt_tokens` fills (the last one partly).
pub fn blocks_for_tokens(prompt_tokens: u64, block_tokens: u32) -> u64 {
    if block_tokens == 0 {
        return 0;
    }
    prompt_tokens.div_ceil(u64::from(block_tokens))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(blocks: &[u32]) -> Vec<BlockId> {
        blocks.iter().map(|&b| BlockId(b)).collect()
    }

    /// `(p block, p token, d block, d token)` of each piece.
    fn pieces(m: BlockSizeMapping, p: &[u32], skip: u32, d: &[u32]) -> Vec<(u32, u32, u32, u32)> {
        let pieces = m.pieces(&ids(p), skip, &ids(d)).unwrap();
        pieces.iter().map(|x| (x.prefill_block.0, x.prefill_token, x.decode_block.0, x.decode_token)).collect()
    }

    #[test]
    fn smaller_prefill_blocks_fill_decode_sub_blocks_clipped_to_the_prompt() {
        let m = BlockSizeMapping::new(4, 16).unwrap();
        assert_eq!(m.piece_tokens(), 4);
        // A 37-token prompt in 4-token P blocks is 10 blocks: D's third block is half empty.
        let p: Vec<u32> = (20..30).collect();
        let got = pieces(m, &p, 0, &[1, 2, 3]);
        assert_eq!(got.len(), 10);
        assert_eq!(got[0], (20, 0, 1, 0));
        assert_eq!(got[3], (23, 0, 1, 12));
        assert_eq!(got[9], (29, 0, 3, 4));
        // Fragmented D blocks keep their order.
        assert_eq!(pieces(m, &[5, 6, 7, 8, 9, 10], 0, &[7, 2]).last(), Some(&(10, 0, 2, 4)));
        // Equal sizes are the identity.
        let same = BlockSizeMapping::new(16, 16).unwrap();
        assert_eq!(pieces(same, &[5, 9], 0, &[3, 4]), vec![(5, 0, 3, 0), (9, 0, 4, 0)]);
    }

    #[test]
    fn larger_prefill_blocks_give_each_decode_block_its_part() {
        let m = BlockSizeMapping::new(32, 16).unwrap();
        assert_eq!(m.piece_tokens(), 16);
        // D block b takes part b % 2 of P block b / 2; a 40-token prompt needs 3 D blocks.
        assert_eq!(pieces(m, &[8, 9], 0, &[1, 4, 6]), vec![(8, 0, 1, 0), (8, 16, 4, 0), (9, 0, 6, 0)]);
        // Starting at the prompt's D block 3 (D's cache holds 0..3): P block 1, from token 16.
        let span = m.prefill_span(3..5);
        assert_eq!(span, PrefillSpan { blocks: 1..3, skip_tokens: 16 });
        assert_eq!(pieces(m, &[11, 12], span.skip_tokens, &[7, 2]), vec![(11, 16, 7, 0), (12, 0, 2, 0)]);
        // What a chunked prefill's finished P blocks hold, in D blocks.
        assert_eq!((m.decode_blocks_in(3), BlockSizeMapping::new(4, 16).unwrap().decode_blocks_in(7)), (6, 1));
        // The other way, a span never skips: D block b starts P block b * m.
        let small = BlockSizeMapping::new(8, 32).unwrap();
        assert_eq!(small.prefill_span(2..4), PrefillSpan { blocks: 8..16, skip_tokens: 0 });
    }

    #[test]
    fn refusals_name_both_sizes() {
        let err = BlockSizeMapping::new(24, 16).unwrap_err();
        assert_eq!(err, BlockSizeError::NotMultiple { prefill_tokens: 24, decode_tokens: 16 });
        assert_eq!(
            err.to_string(),
            "block size mismatch: neither the prefill block of 24 tokens nor the decode block of 16 tokens is a multiple of the other"
        );
        assert!(matches!(BlockSizeMapping::new(16, 24), Err(BlockSizeError::NotMultiple { .. })));
        assert!(BlockSizeMapping::new(32, 16).is_ok(), "P blocks twice D's are mapped");
        assert!(matches!(BlockSizeMapping::new(0, 16), Err(BlockSizeError::Zero { .. })));
        let m = BlockSizeMapping::new(4, 16).unwrap();
        assert_eq!(
            m.pieces(&ids(&[1, 2, 3, 4, 5]), 0, &ids(&[1])).unwrap_err(),
            BlockSizeError::TooFewDecodeBlocks { decode_blocks: 1, decode_tokens: 16, prefill_tokens: 20 }
        );
        let big = BlockSizeMapping::new(32, 16).unwrap();
        assert_eq!(
            big.pieces(&ids(&[1]), 16, &ids(&[4, 5])).unwrap_err().to_string(),
            "2 decode blocks of 16 tokens need more than 16 tokens of prefill blocks"
        );
        assert_eq!(
            big.pieces(&ids(&[1]), 8, &ids(&[4])).unwrap_err().to_string(),
            "cannot skip 8 tokens of a prefill block of 32 tokens in pieces of 16 tokens"
        );
        assert!(matches!(big.pieces(&ids(&[1, 2]), 32, &ids(&[4])), Err(BlockSizeError::Skip { .. })));
    }

    #[test]
    fn prefill_blocks_that_do_not_reach_every_decode_block_are_refused() {
        // An export cut short (a made-up handoff): D's blocks past P's would hold no KV.
        let same = BlockSizeMapping::new(16, 16).unwrap();
        assert_eq!(
            same.pieces(&ids(&[1]), 0, &ids(&[4, 5, 6, 7, 8])).unwrap_err(),
            BlockSizeError::TooFewPrefillBlocks { decode_blocks: 5, decode_tokens: 16, prefill_tokens: 16 }
        );
        assert_eq!(same.pieces(&ids(&[1, 2]), 0, &ids(&[4, 5])).unwrap().len(), 2);
        // P smaller: reaching into D's last block is enough (the prompt ends there).
        let small = BlockSizeMapping::new(4, 16).unwrap();
        let eight: Vec<u32> = (20..28).collect();
        assert!(matches!(
            small.pieces(&ids(&eight), 0, &ids(&[1, 2, 3])),
            Err(BlockSizeError::TooFewPrefillBlocks { .. })
        ));
        let nine: Vec<u32> = (20..29).collect();
        assert_eq!(small.pieces(&ids(&nine), 0, &ids(&[1, 2, 3])).unwrap().len(), 9);
    }
}
