//! The cluster's byte oracle: the fill pattern P computes into its blocks, each rank's pool
//! memory, the scrub of freed blocks, the byte-for-byte check of D's loads, and the count of
//! writes into freed blocks.
//!
//! Every byte P computes is a mix of (engine, request, generation, position) and never the
//! scrub byte, so a scrubbed block never passes for data, and a block read after its free
//! shows as corrupt.

use std::collections::BTreeSet;

use kv_core::{BlockId, EngineId, Memory, PoolShape, Region, RequestId};
use kv_sched_adapter::RemoteRef;

use super::{Cluster, DecodeEngine};
use crate::{BlockPool, InMemoryMemory};

use crate::pattern::SCRUB;

/// One worker's memory: its pool region and shape (a pipeline stage's layers), and its TP rank.
pub(super) struct RankMemory {
    memory: InMemoryMemory,
    region: Region,
    shape: PoolShape,
    rank: u32,
}

impl RankMemory {
    /// Where `blocks` lie in this rank's memory, as `(address, length)` ranges.
    pub(super) fn block_ranges(&self, blocks: &[BlockId]) -> Vec<(u64, u64)> {
        blocks.iter().flat_map(|b| self.shape.block_ranges(&[self.region.addr], b.0)).collect()
    }

    /// Bytes of one block of this rank's pool.
    pub(super) fn block_bytes(&self) -> u64 {
        self.shape.block_bytes()
    }

    /// TP rank `rank`'s pool of `shape` in `region` of `memory`, every block scrubbed: free.
    pub(super) fn new(memory: InMemoryMemory, region: Region, shape: PoolShape, rank: u32) -> Self {
        let mut mem = RankMemory { memory, region, shape, rank };
        let all: Vec<BlockId> = (0..shape.num_blocks).map(BlockId).collect();
        mem.scrub(&all);
        mem
    }

    fn block_offset(&self, block: BlockId) -> u64 {
        u64::from(block.0) * self.shape.block_bytes()
    }

    fn scrub(&mut self, blocks: &[BlockId]) {
        let scrub = vec![SCRUB; self.shape.block_bytes() as usize];
        for &b in blocks {
            let _ = self.memory.write(self.region.id, self.block_offset(b), &scrub);
        }
    }

    fn scrubbed(&self, block: BlockId) -> bool {
        let mut bytes = vec![0; self.shape.block_bytes() as usize];
        self.memory.read(self.region.id, self.block_offset(block), &mut bytes).is_ok()
            && bytes.iter().all(|&b| b == SCRUB)
    }
}

/// The byte P computes at a position of a prompt's KV: a mix of everything that names it.
fn kv_byte(seed: u64, layer: u32, plane: u32, head: u32, token: u64, e: u64) -> u8 {
    let mut x =
        seed ^ (u64::from(layer) << 56) ^ (u64::from(plane) << 52) ^ (u64::from(head) << 40) ^ (token << 12) ^ e;
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    let byte = x as u8;
    // Never the scrub byte, so a scrubbed block never passes for data.
    if byte == SCRUB {
        0
    } else {
        byte
    }
}

/// The bytes of one block on one rank: `[layer][plane][head][token][elem]` (block-major, HND),
/// the rank's layers only.
fn block_bytes(shape: &PoolShape, first_head: u32, seed: u64, first_token: u64, valid_tokens: u64) -> Vec<Option<u8>> {
    let l = shape.layout;
    let elems = shape.head_bytes_per_token();
    let mut out = Vec::with_capacity(shape.block_bytes() as usize);
    for layer in shape.layers.first..shape.layers.end() {
        for plane in 0..l.planes() {
            for h in 0..shape.heads {
                for t in 0..u64::from(l.block_tokens) {
                    let token = first_token + t;
                    for e in 0..elems {
                        out.push((token < valid_tokens).then(|| kv_byte(seed, layer, plane, first_head + h, token, e)));
                    }
                }
            }
        }
    }
    out
}

/// What P computed for an export: the oracle D's bytes are checked against.
#[derive(Clone, Copy, Debug)]
pub(super) struct Computed {
    pub(super) seed: u64,
    /// Tokens P wrote: its blocks, whole.
    pub(super) tokens: u64,
}

/// Whether some rank finds `block`, free since it was scrubbed, written to.
fn written_while_free(ranks: &[RankMemory], block: BlockId) -> bool {
    ranks.iter().any(|r| !r.scrubbed(block))
}

/// The blocks just allocated that were written to while they were free.
pub(super) fn dirty(ranks: &[RankMemory], blocks: &[BlockId]) -> BTreeSet<BlockId> {
    blocks.iter().copied().filter(|&b| written_while_free(ranks, b)).collect()
}

/// P computes a prompt into `blocks` on every rank of a TP group of `tp`: the bytes of seed
/// `seed`, `block_tokens` tokens to a block, all of them valid.
pub(super) fn fill(ranks: &mut [RankMemory], tp: u32, blocks: &[BlockId], seed: u64, block_tokens: u32) {
    for rank in ranks {
        let first = rank.shape.layout.first_head(rank.rank, tp);
        for (i, &block) in blocks.iter().enumerate() {
            let bytes: Vec<u8> = block_bytes(&rank.shape, first, seed, i as u64 * u64::from(block_tokens), u64::MAX)
                .into_iter()
                .map(|b| b.unwrap_or(0))
                .collect();
            let _ = rank.memory.write(rank.region.id, rank.block_offset(block), &bytes);
        }
    }
}

impl Cluster {
    /// Gives `blocks` back to an engine's pool and scrubs those that are free now (a sibling
    /// may still hold the rest); a block freed twice is a violation.
    pub(super) fn free_blocks(
        &mut self,
        engine: &EngineId,
        pool: &mut BlockPool,
        ranks: &mut [RankMemory],
        blocks: &[BlockId],
    ) {
        match pool.release(blocks) {
            Ok(freed) => {
                for rank in ranks {
                    rank.scrub(&freed);
                }
            }
            Err(block) => self.violation(format!("{engine}: block {block} freed twice")),
        }
    }

    /// Compares the first `kept` blocks of a request that ended (all of them when it is ready,
    /// the intact prefix D keeps when it recomputes the rest) on every D rank with what P
    /// computed.
    /// What P computed for the export `remote` names. Push mode matches by transfer id, and by
    /// base id when the engines' suffixes differ; so does the oracle, when one computed request
    /// has that base.
    pub(super) fn computed_for(&self, remote: &RemoteRef) -> Option<Computed> {
        let mut key = (remote.prefill.engine.clone(), remote.request.clone());
        if let Some(request) = self.transfers.get(&key) {
            key.1 = request.clone();
        }
        self.computed.get(&key).copied().or_else(|| {
            let base = key.1.base();
            let mut matches = self.computed.iter().filter(|((e, r), _)| *e == key.0 && r.base() == base);
            match (matches.next(), matches.next()) {
                (Some((_, c)), None) => Some(*c),
                _ => None,
            }
        })
    }

    pub(super) fn verify(&mut self, engine: &DecodeEngine, request: &RequestId, kept: usize) {
        let Some(load) = engine.loads.get(request) else { return };
        if load.prefix_hit() || kept == 0 {
            return;
        }
        let Some(computed) = self.computed_for(&load.remote) else {
            if load.cache_pending {
                // P has computed nothing for it yet: nothing reached its blocks, and the ones D
                // keeps are its own prefix cache's.
                return;
            }
            let message =
                format!("{}: {request} is ready, but its P never computed {}", engine.id, load.remote.request);
            self.violation(message);
            return;
        };
        let d_tokens = u64::from(self.config.spec.decode_block_size);
        let mut corrupt = false;
        for rank in &engine.ranks {
            let first = rank.shape.layout.first_head(rank.rank, self.config.spec.decode_tp);
            for (i, &block) in load.blocks.iter().take(kept).enumerate() {
                let expected = block_bytes(&rank.shape, first, computed.seed, i as u64 * d_tokens, computed.tokens);
                let mut got = vec![0; expected.len()];
                if rank.memory.read(rank.region.id, rank.block_offset(block), &mut got).is_err() {
                    corrupt = true;
                    continue;
                }
                if expected.iter().zip(&got).any(|(e, g)| e.is_some_and(|e| e != *g)) {
                    corrupt = true;
                }
            }
        }
        if corrupt {
            self.corrupt_reads += 1;
            self.record(format!("{} CORRUPT {request}", engine.id));
        } else {
            self.loads_verified += 1;
        }
    }

    /// Blocks found written while free, when they are allocated again.
    pub(super) fn count_written_after_free(&mut self, node: &str, dirty: &BTreeSet<BlockId>) {
        for block in dirty {
            self.record(format!("{node}: freed block {block} was WRITTEN AFTER FREE"));
        }
        self.written_after_free += dirty.len() as u64;
    }

    /// Loads whose bytes did not match what P computed.
    pub fn corrupt_reads(&self) -> u64 {
        self.corrupt_reads
    }

    /// Writes that landed in blocks their engine had already given back to its pool: those
    /// found when the block was allocated again, and those in blocks free now.
    pub fn written_after_free(&self) -> u64 {
        let free_dirty = |pool: &BlockPool, ranks: &[RankMemory]| {
            pool.free_blocks().filter(|&b| written_while_free(ranks, b)).count() as u64
        };
        let p: u64 = self.prefill.values().flatten().map(|e| free_dirty(&e.pool, &e.ranks)).sum();
        let d: u64 = self.decode.values().flatten().map(|e| free_dirty(&e.pool, &e.ranks)).sum();
        self.written_after_free + p + d
    }

    /// Writes found in blocks at their next allocation after a free (cheap: no scan).
    pub fn written_after_free_found(&self) -> u64 {
        self.written_after_free
    }

    /// Loads whose bytes matched what P computed.
    pub fn loads_verified(&self) -> u64 {
        self.loads_verified
    }
}
