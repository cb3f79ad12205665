//! Block-size mapping: P's blocks may be smaller than D's, never larger.
//!
//! With `d_block = m * p_block`, D block `b` is viewed as the `m` sub-blocks
//! `b*m .. b*m + m - 1`, each the size of a P block; P's blocks pair with D's sub-blocks in
//! order, clipped to the prompt, and the tail of D's last block is left untransferred.

use crate::id::BlockId;

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
    /// D's block is not a whole multiple of P's (including P larger than D).
    #[error(
        "block size mismatch: decode block of {decode_tokens} tokens is not a multiple of prefill block of {prefill_tokens} tokens"
    )]
    NotMultiple {
        /// P's tokens per block.
        prefill_tokens: u32,
        /// D's tokens per block.
        decode_tokens: u32,
    },
    /// D's blocks cannot hold all of P's blocks.
    #[error("{decode_blocks} decode blocks of ratio {ratio} hold {capacity} prefill blocks, need {prefill_blocks}")]
    TooFewDecodeBlocks {
        /// D blocks given.
        decode_blocks: usize,
        /// P blocks per D block.
        ratio: u32,
        /// `decode_blocks * ratio`.
        capacity: u64,
        /// P blocks to place.
        prefill_blocks: usize,
    },
}

/// A validated pairing of P's and D's block sizes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct BlockSizeMapping {
    prefill_tokens: u32,
    ratio: u32,
}

/// One P-block-sized piece of a D block.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct SubBlock {
    /// The D block.
    pub block: BlockId,
    /// Which piece of it, `0..ratio`.
    pub index: u32,
}

impl SubBlock {
    /// The sub-block's index in D's pool viewed at P's block size: `block * ratio + index`.
    pub fn flat(&self, ratio: u32) -> u64 {
        u64::from(self.block.0) * u64::from(ratio) + u64::from(self.index)
    }
}

impl BlockSizeMapping {
    /// Pairs P blocks of `prefill_tokens` with D blocks of `decode_tokens`.
    pub fn new(prefill_tokens: u32, decode_tokens: u32) -> Result<Self, BlockSizeError> {
        if prefill_tokens == 0 || decode_tokens == 0 {
            return Err(BlockSizeError::Zero { prefill_tokens, decode_tokens });
        }
        if decode_tokens % prefill_tokens != 0 {
            return Err(BlockSizeError::NotMultiple { prefill_tokens, decode_tokens });
        }
        Ok(BlockSizeMapping { prefill_tokens, ratio: decode_tokens / prefill_tokens })
    }

    /// P blocks per D block.
    pub fn ratio(&self) -> u32 {
        self.ratio
    }

    /// P's tokens per block.
    pub fn prefill_tokens(&self) -> u32 {
        self.prefill_tokens
    }

    /// D's sub-blocks that receive `prefill_blocks` P blocks, in order, clipped to them.
    pub fn sub_blocks(
        &self,
        decode_blocks: &[BlockId],
        prefill_blocks: usize,
    ) -> Result<Vec<SubBlock>, BlockSizeError> {
        let capacity = decode_blocks.len() as u64 * u64::from(self.ratio);
        if capacity < prefill_blocks as u64 {
            return Err(BlockSizeError::TooFewDecodeBlocks {
                decode_blocks: decode_blocks.len(),
                ratio: self.ratio,
                capacity,
                prefill_blocks,
            });
        }
        Ok(decode_blocks
            .iter()
            .flat_map(|&block| (0..self.ratio).map(move |index| SubBlock { block, index }))
            .take(prefill_blocks)
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

    fn flat(mapping: BlockSizeMapping, local: &[u32], prefill_blocks: usize) -> Vec<u64> {
        let local: Vec<BlockId> = local.iter().map(|&b| BlockId(b)).collect();
        mapping.sub_blocks(&local, prefill_blocks).unwrap().iter().map(|s| s.flat(mapping.ratio())).collect()
    }

    #[test]
    fn local_blocks_map_to_sub_blocks_clipped_to_the_prompt() {
        let m = BlockSizeMapping::new(4, 16).unwrap();
        assert_eq!(m.ratio(), 4);
        assert_eq!(flat(m, &[1, 2, 3], 12), (4..=15).collect::<Vec<_>>());
        // A 37-token prompt in 4-token P blocks is 10 blocks: the last two sub-blocks stay empty.
        let prompt = blocks_for_tokens(37, 4) as usize;
        assert_eq!(prompt, 10);
        assert_eq!(flat(m, &[1, 2, 3], prompt), (4..=13).collect::<Vec<_>>());
        // Fragmented D blocks keep their order.
        assert_eq!(flat(m, &[7, 2], 6), vec![28, 29, 30, 31, 8, 9]);
        // Equal sizes are the identity.
        let same = BlockSizeMapping::new(16, 16).unwrap();
        assert_eq!(flat(same, &[5, 9], 2), vec![5, 9]);
    }

    #[test]
    fn refusals_name_both_sizes() {
        let err = BlockSizeMapping::new(32, 16).unwrap_err();
        assert_eq!(err, BlockSizeError::NotMultiple { prefill_tokens: 32, decode_tokens: 16 });
        assert_eq!(
            err.to_string(),
            "block size mismatch: decode block of 16 tokens is not a multiple of prefill block of 32 tokens"
        );
        assert!(matches!(BlockSizeMapping::new(16, 24), Err(BlockSizeError::NotMultiple { .. })));
        assert!(matches!(BlockSizeMapping::new(0, 16), Err(BlockSizeError::Zero { .. })));
        let m = BlockSizeMapping::new(4, 16).unwrap();
        let err = m.sub_blocks(&[BlockId(1)], 5).unwrap_err();
        assert_eq!(
            err,
            BlockSizeError::TooFewDecodeBlocks { decode_blocks: 1, ratio: 4, capacity: 4, prefill_blocks: 5 }
        );
    }
}
