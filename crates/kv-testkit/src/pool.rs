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
}

impl BlockPool {
    /// A pool of `blocks` free blocks.
    pub fn new(blocks: u32) -> Self {
        BlockPool { free: (0..blocks).collect(), refs: BTreeMap::new() }
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
        let mut freed = Vec::new();
        for b in blocks {
            let refs = self.refs.get_mut(&b.0).ok_or(*b)?;
            *refs -= 1;
            if *refs == 0 {
                self.refs.remove(&b.0);
                self.free.insert(b.0);
                freed.push(*b);
            }
        }
        Ok(freed)
    }

    /// Blocks with at least one reference.
    pub fn held(&self) -> usize {
        self.refs.len()
    }

    /// The free blocks, lowest first.
    pub fn free_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.free.iter().map(|&b| BlockId(b))
    }
}
