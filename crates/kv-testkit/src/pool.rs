//! A KV pool's block allocator with reference counts, as an engine keeps one: the lowest
//! free ids first (so freed blocks are soon reused, and a read after free soon shows), and
//! one reference per holder (parallel-sampling siblings share a prompt's blocks).

use std::collections::{BTreeMap, BTreeSet};

use kv_core::BlockId;

/// Block allocation with reference counts (siblings share a prompt's blocks).
#[derive(Clone, Debug)]
pub struct BlockPool {
    free: BTreeSet<u32>,
    refs: BTreeMap<u32, u32>,
    /// Released by [`BlockPool::release_later`], not given back yet.
    kept: BTreeSet<u32>,
}

impl BlockPool {
    /// A pool of `blocks` free blocks.
    pub fn new(blocks: u32) -> Self {
        BlockPool { free: (0..blocks).collect(), refs: BTreeMap::new(), kept: BTreeSet::new() }
    }

    /// Takes the `count` lowest free blocks, each with one reference; `None` if too few are free.
    pub fn allocate(&mut self, count: usize) -> Option<Vec<BlockId>> {
        if self.free.len() < count {
            return None;
        }
        let blocks: Vec<u32> = self.free.iter().take(count).copied().collect();
        for b in &blocks {
            self.free.remove(b);
            self.refs.insert(*b, 1);
        }
        Some(blocks.into_iter().map(BlockId).collect())
    }

    /// Adds a reference to each block.
    pub fn retain(&mut self, blocks: &[BlockId]) {
        for b in blocks {
            *self.refs.entry(b.0).or_default() += 1;
        }
    }

    /// Drops one reference to each block; returns those now free, or the block freed twice.
    pub fn release(&mut self, blocks: &[BlockId]) -> Result<Vec<BlockId>, BlockId> {
        let freed = self.release_later(blocks)?;
        self.give_back(&freed);
        Ok(freed)
    }

    /// Drops one reference to each block, as [`BlockPool::release`], but keeps those left
    /// with none out of the free set until [`BlockPool::give_back`]: for an engine that
    /// scrubs a freed block before it can be allocated again.
    pub fn release_later(&mut self, blocks: &[BlockId]) -> Result<Vec<BlockId>, BlockId> {
        let mut freed = Vec::new();
        for b in blocks {
            let refs = self.refs.get_mut(&b.0).ok_or(*b)?;
            *refs -= 1;
            if *refs == 0 {
                self.refs.remove(&b.0);
                self.kept.insert(b.0);
                freed.push(*b);
            }
        }
        Ok(freed)
    }

    /// Makes blocks that [`BlockPool::release_later`] kept free; others are left as they are.
    pub fn give_back(&mut self, blocks: &[BlockId]) {
        for b in blocks {
            if self.kept.remove(&b.0) {
                self.free.insert(b.0);
            }
        }
    }

    /// Blocks not free: with at least one reference, or kept back by
    /// [`BlockPool::release_later`].
    pub fn held(&self) -> usize {
        self.refs.len() + self.kept.len()
    }

    /// The free blocks, lowest first.
    pub fn free_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.free.iter().map(|&b| BlockId(b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_released_later_is_not_allocated_until_given_back() {
        let mut pool = BlockPool::new(2);
        let blocks = pool.allocate(2).expect("two free");
        assert_eq!(pool.release_later(&blocks[..1]), Ok(vec![BlockId(0)]));
        assert_eq!(pool.held(), 2, "the kept block is not free");
        assert_eq!(pool.allocate(1), None);
        pool.give_back(&[BlockId(0)]);
        assert_eq!(pool.held(), 1);
        assert_eq!(pool.allocate(1), Some(vec![BlockId(0)]));
        assert_eq!(pool.release(&[BlockId(1)]), Ok(vec![BlockId(1)]));
        assert_eq!(pool.release(&[BlockId(1)]), Err(BlockId(1)), "freed twice");
    }
}
