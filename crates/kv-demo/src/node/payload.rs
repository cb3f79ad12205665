//! The engine's payload work, on threads of its own: filling a prompt's blocks (P's stand-in
//! for computing them, D's for its prefix cache), checking every byte D received, checking
//! that a freed block still holds its scrub when it is allocated again, and scrubbing freed
//! blocks; with a model (`--model`), computing a prompt's KV into its blocks chunk by chunk
//! (P's prefill, D's prefix cache) and decoding from the KV D loaded instead of the pattern.
//! Each is bytes in proportion to the prompt (tens of milliseconds for a large one); done on
//! the engine's thread they held up the control plane behind them (every other
//! request's reports, frees and readiness), which is what a real engine's GPU work does not do.
//!
//! The engine's thread hands [`Work`] to [`Workers`] with a tag of its own, and takes the
//! [`Done`] back in its loop (each one unparks it). Blocks under work stay held by the engine
//! until their work is done: a block being scrubbed is not free, and a block being checked is
//! not scrubbed.

use std::collections::{HashMap, VecDeque};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::{JoinHandle, Thread};
use std::time::Instant;

use anyhow::{anyhow, Context, Result};
use kv_core::{BlockId, Memory, MemoryError, MemoryKind, PoolShape, Region, RegionId};
use kv_model::{PoolKv, RankRegions, TinyLlama};

use kv_testkit::pattern;

use crate::proto::Generated;

/// Payload threads per engine: as many as the machine has cores, up to four (each job is one
/// prompt's bytes, so a few threads already keep several prompts apart).
fn thread_count() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(1, 4)
}

/// One TP rank's part of the pool: its region, its shape (its heads), and its first head.
pub(super) struct RankPool {
    pub(super) region: Region,
    pub(super) shape: PoolShape,
    pub(super) first_head: u32,
}

/// The pool's memory and where each rank's part of it lies, shared by the payload threads.
/// Each thread copies a layer's part of a block at a time under the lock; making and checking
/// the bytes happens outside it.
pub(super) struct PoolBytes {
    memory: Mutex<Box<dyn Memory>>,
    /// By rank; the same block ids on every rank.
    ranks: Vec<RankPool>,
    /// The model the engine runs, if it runs one (`--model`).
    model: Option<TinyLlama>,
    /// By prompt, of the chunk the model computes layer by layer: its end (tokens) and the
    /// layers of it stored so far (P reports them to its connector as they come).
    layers_stored: Mutex<HashMap<String, (usize, u32)>>,
}

impl PoolBytes {
    pub(super) fn new(memory: Box<dyn Memory>, ranks: Vec<RankPool>, model: Option<TinyLlama>) -> Self {
        PoolBytes { memory: Mutex::new(memory), ranks, model, layers_stored: Mutex::default() }
    }

    /// Of the chunk of prompt `id` the model computes layer by layer: its end (tokens) and
    /// the layers stored so far.
    pub(super) fn layers_stored(&self, id: &str) -> Option<(usize, u32)> {
        self.layers_stored.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).get(id).copied()
    }

    /// Forgets prompt `id`'s layers (it is exported, or given up).
    pub(super) fn forget_layers(&self, id: &str) {
        self.layers_stored.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).remove(id);
    }

    /// The model the engine runs, if any.
    pub(super) fn model(&self) -> Option<&TinyLlama> {
        self.model.as_ref()
    }

    /// Runs `f` with the model and a sequence's KV in `blocks` of every rank's pool, as the
    /// model reads and writes it (each KV head in the pool of the rank that owns it).
    fn with_kv<R>(&self, blocks: &[BlockId], f: impl FnOnce(&TinyLlama, &mut PoolKv) -> Result<R>) -> Result<R> {
        let model = self.model.as_ref().ok_or_else(|| anyhow!("model work for an engine that runs no model"))?;
        let ranks = self
            .ranks
            .iter()
            .map(|rank| RankRegions {
                shape: rank.shape,
                regions: (0..rank.shape.region_count())
                    .map(|i| (rank.region.id, u64::from(i) * rank.shape.region_len()))
                    .collect(),
            })
            .collect();
        let mut memory = Locked(&self.memory);
        let mut kv = PoolKv::in_memory(&mut memory, ranks, blocks)?;
        f(model, &mut kv)
    }

    /// Computes `prompt[from..to]` into `blocks` (the prompt's, in order) in chunks of
    /// `chunk`; the greedy choice after the prompt's last token, if `to` reaches it. With
    /// `layers_of` a prompt's id, notes each layer of each chunk as the model stores it
    /// ([`PoolBytes::layers_stored`]) and wakes `engine`.
    fn compute(
        &self,
        prompt: &[u32],
        blocks: &[BlockId],
        (from, to): (usize, usize),
        chunk: usize,
        layers_of: Option<&str>,
        engine: &Thread,
    ) -> Result<Option<crate::proto::Choice>> {
        self.with_kv(blocks, |model, kv| {
            let mut logits = Vec::new();
            let mut at = from;
            while at < to {
                let end = (at + chunk.max(1)).min(to);
                let mut stored = |layer: usize| {
                    if let Some(id) = layers_of {
                        let mut notes = self.layers_stored.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                        notes.insert(id.to_owned(), (end, layer as u32 + 1));
                        drop(notes);
                        engine.unpark();
                    }
                };
                logits = model.forward_layers(&prompt[at..end], at, kv, &mut stored)?;
                at = end;
            }
            let last = to == prompt.len() && !logits.is_empty();
            Ok(last.then(|| {
                let choice = kv_model::Choice::greedy(&logits);
                crate::proto::Choice { token: choice.token, margin: choice.margin }
            }))
        })
    }

    /// Decodes `count` tokens after `first` from the KV of a prompt of `prompt_tokens` in
    /// `blocks` (the prompt's, then those for the tokens decoded); then, as the control,
    /// decodes them again from the prompt's KV zeroed.
    fn decode(&self, blocks: &[BlockId], prompt_tokens: usize, first: u32, count: usize) -> Result<Generated> {
        self.with_kv(blocks, |model, kv| {
            let kv_fingerprint = model.kv_fingerprint(kv, prompt_tokens)?;
            let started = Instant::now();
            let decoded = model.decode(first, prompt_tokens, count, kv)?;
            let decode_ns = started.elapsed().as_nanos() as u64;
            model.zero_kv(kv, prompt_tokens)?;
            let zeroed = model.decode(first, prompt_tokens, count, kv)?;
            Ok(Generated {
                ids: [&[first][..], &decoded.tokens].concat(),
                zeroed_ids: [&[first][..], &zeroed.tokens].concat(),
                kv_fingerprint,
                min_margin: decoded.min_margin,
                first_at_ns: 0,
                decode_ns,
            })
        })
    }

    /// The shape of one rank's part of the pool.
    pub(super) fn shape(&self) -> PoolShape {
        self.ranks[0].shape
    }

    pub(super) fn rank_count(&self) -> usize {
        self.ranks.len()
    }

    /// Where rank `rank`'s part of `block` at `layer` starts, as (region, offset in it): the
    /// layer's planes of that block, adjacent.
    fn place(&self, rank: usize, layer: u32, block: BlockId) -> (RegionId, u64) {
        let pool = &self.ranks[rank];
        let at = pool.shape.plane_offset(layer, block.0, 0);
        (pool.region.id, u64::from(at.region) * pool.shape.region_len() + at.offset)
    }

    /// Every (rank, layer) part of `block`, as (rank, layer, region, offset).
    fn parts(&self, block: BlockId) -> impl Iterator<Item = (usize, u32, RegionId, u64)> + '_ {
        (0..self.shape().layout.layers).flat_map(move |layer| {
            (0..self.ranks.len()).map(move |rank| {
                let (region, at) = self.place(rank, layer, block);
                (rank, layer, region, at)
            })
        })
    }

    /// The chunks rank `rank` holds of the block at `position` of a prompt, one per plane of
    /// `layer`, in the order they lie in the layer's part of the block.
    fn chunks(&self, rank: usize, layer: u32, position: usize) -> impl Iterator<Item = pattern::Chunk> {
        let (shape, first_head) = (self.ranks[rank].shape, self.ranks[rank].first_head);
        let layout = shape.layout;
        (0..layout.planes()).map(move |plane| pattern::Chunk {
            layer,
            plane,
            first_head,
            heads: shape.heads,
            first_token: position as u64 * u64::from(layout.block_tokens),
            tokens: layout.block_tokens,
            row_bytes: shape.head_bytes_per_token() as usize,
            order: layout.order,
        })
    }

    fn read(&self, region: RegionId, at: u64, out: &mut [u8]) -> Result<()> {
        step_aside();
        let memory = self.memory.lock().map_err(|_| anyhow!("a payload thread panicked"))?;
        Ok(memory.read(region, at, out)?)
    }

    fn write(&self, region: RegionId, at: u64, data: &[u8]) -> Result<()> {
        step_aside();
        let mut memory = self.memory.lock().map_err(|_| anyhow!("a payload thread panicked"))?;
        Ok(memory.write(region, at, data)?)
    }

    /// Fills `blocks`, in prompt order, with the prompt's bytes on every rank.
    fn fill(&self, chunk: &mut [u8], seed: u64, blocks: &[BlockId], first: usize) -> Result<()> {
        let plane_bytes = self.shape().plane_bytes() as usize;
        for (position, &block) in (first..).zip(blocks) {
            for (rank, layer, region, at) in self.parts(block) {
                for (i, c) in self.chunks(rank, layer, position).enumerate() {
                    pattern::fill(&mut chunk[i * plane_bytes..(i + 1) * plane_bytes], seed, &c);
                }
                self.write(region, at, chunk)?;
            }
        }
        Ok(())
    }

    /// Whether `blocks`, in prompt order, hold the bytes of a prompt of `tokens` tokens on
    /// every rank.
    fn check(&self, chunk: &mut [u8], seed: u64, blocks: &[BlockId], tokens: u64) -> Result<bool> {
        let plane_bytes = self.shape().plane_bytes() as usize;
        let mut all = true;
        for (position, &block) in blocks.iter().enumerate() {
            for (rank, layer, region, at) in self.parts(block) {
                self.read(region, at, chunk)?;
                for (i, c) in self.chunks(rank, layer, position).enumerate() {
                    all &= pattern::check(&chunk[i * plane_bytes..(i + 1) * plane_bytes], seed, &c, tokens);
                }
            }
        }
        Ok(all)
    }

    /// How many of `blocks` no longer hold their scrub on some rank: written after they were
    /// freed.
    fn written_after_free(&self, chunk: &mut [u8], blocks: &[BlockId]) -> Result<u64> {
        let mut written = 0;
        for &block in blocks {
            for (_, _, region, at) in self.parts(block) {
                self.read(region, at, chunk)?;
                if !pattern::is_scrub(chunk) {
                    written += 1;
                    break;
                }
            }
        }
        Ok(written)
    }

    /// Writes the scrub over `blocks` on every rank.
    fn scrub(&self, chunk: &mut [u8], blocks: &[BlockId]) -> Result<()> {
        chunk.fill(pattern::SCRUB);
        for &block in blocks {
            for (_, _, region, at) in self.parts(block) {
                self.write(region, at, chunk)?;
            }
        }
        Ok(())
    }
}

/// The pool's memory as the model reads and writes it, the lock taken for each copy (as the
/// other payload threads take it), so that a prompt's compute does not hold up their work.
struct Locked<'a>(&'a Mutex<Box<dyn Memory>>);

impl Memory for Locked<'_> {
    fn allocate(&mut self, kind: MemoryKind, len: u64) -> Result<Region, MemoryError> {
        let reason = "the model's view of the pool allocates nothing".to_owned();
        Err(MemoryError::Allocation { kind, len, reason })
    }

    fn free(&mut self, region: RegionId) -> Result<(), MemoryError> {
        Err(MemoryError::UnknownRegion(region))
    }

    fn read(&self, region: RegionId, offset: u64, out: &mut [u8]) -> Result<(), MemoryError> {
        // A payload thread that panicked fails the engine; the bytes are still the pool's.
        self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).read(region, offset, out)
    }

    fn write(&mut self, region: RegionId, offset: u64, data: &[u8]) -> Result<(), MemoryError> {
        self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).write(region, offset, data)
    }
}

/// Payload work on blocks the engine holds.
pub(super) enum Work {
    /// Checks the scrub of `freed` (blocks freed before, allocated again), then fills
    /// `blocks`, in prompt order from the prompt's block `first`, with the bytes of the prompt
    /// `seed` names.
    Fill { seed: u64, blocks: Vec<BlockId>, freed: Vec<BlockId>, first: usize },
    /// Checks `blocks`, in prompt order, against the bytes of the prompt of `tokens` tokens
    /// `seed` names.
    Check { seed: u64, blocks: Vec<BlockId>, tokens: u64 },
    /// Scrubs `blocks`.
    Scrub { blocks: Vec<BlockId> },
    /// With a model: checks the scrub of `freed`, then computes `prompt[from..to]` into
    /// `blocks` (the prompt's, in order) in chunks of `chunk` tokens; P's chunk of a prefill,
    /// or D's own prefix cache of a partial prefix hit. With `layers_of` (P's prompt id), each
    /// layer is noted as the model stores it ([`PoolBytes::layers_stored`]).
    Compute {
        prompt: Arc<[u32]>,
        blocks: Vec<BlockId>,
        freed: Vec<BlockId>,
        from: usize,
        to: usize,
        chunk: usize,
        layers_of: Option<String>,
    },
    /// With a model: decodes `count` tokens after P's `first` from the KV of a prompt of
    /// `prompt_tokens` tokens in `blocks`, then the control from the same KV zeroed.
    Decode { blocks: Vec<BlockId>, prompt_tokens: usize, first: u32, count: usize },
}

/// What model work gave.
pub(super) enum ModelOut {
    /// A `Compute` that reached the prompt's end: its first token.
    First(crate::proto::Choice),
    /// A `Decode`.
    Generated(Generated),
}

/// Work done, with the engine's tag.
pub(super) struct Done<T> {
    pub(super) tag: T,
    /// Of a `Fill`: freed blocks that no longer held their scrub.
    pub(super) written_after_free: u64,
    /// Of a `Check`: whether every byte was the prompt's.
    pub(super) intact: bool,
    /// When the engine handed the work over: the engine times it when it takes the result up,
    /// so that the hand-back is counted too.
    pub(super) handed: Instant,
    /// A failure of the memory port: the engine cannot go on.
    pub(super) failed: Option<String>,
    /// What model work gave.
    pub(super) model: Option<ModelOut>,
}

/// The payload threads, seen from the engine's.
pub(super) struct Workers<T> {
    queue: Arc<Queue<T>>,
    done: Receiver<Done<T>>,
    joins: Vec<JoinHandle<()>>,
}

/// Work waiting for a payload thread, in two lines: what a load or an export waits for
/// (fills, computes, scrubs, decodes) first, and the checks of bytes D already said it holds
/// last. A check is the demo's proof, not the load's path: behind it, a new load's scrub check
/// waited tens of milliseconds on a busy engine. Checks still run whenever the first line is
/// empty, and the blocks they check stay held until they do.
struct Queue<T> {
    pending: Mutex<Pending<T>>,
    wake: Condvar,
}

struct Pending<T> {
    first: VecDeque<(T, Work, Instant)>,
    last: VecDeque<(T, Work, Instant)>,
    /// The engine dropped its side: threads end once nothing is pending.
    closed: bool,
}

impl<T> Queue<T> {
    fn new() -> Self {
        let pending = Pending { first: VecDeque::new(), last: VecDeque::new(), closed: false };
        Queue { pending: Mutex::new(pending), wake: Condvar::new() }
    }

    fn push(&self, tag: T, work: Work) {
        let mut pending = self.pending.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let line = if matches!(work, Work::Check { .. }) { &mut pending.last } else { &mut pending.first };
        line.push_back((tag, work, Instant::now()));
        drop(pending);
        self.wake.notify_one();
    }

    /// The next piece of work, first line first; `None` once closed and empty.
    fn pop(&self) -> Option<(T, Work, Instant)> {
        let mut pending = self.pending.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        loop {
            if let Some(next) = pending.first.pop_front().or_else(|| pending.last.pop_front()) {
                return Some(next);
            }
            if pending.closed {
                return None;
            }
            pending = self.wake.wait(pending).unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }

    fn close(&self) {
        self.pending.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).closed = true;
        self.wake.notify_all();
    }
}

impl<T: Send + 'static> Workers<T> {
    /// Starts the threads over `pool`; each finished piece of work wakes `engine`.
    pub(super) fn spawn(pool: Arc<PoolBytes>, engine: Thread) -> Result<Self> {
        let queue = Arc::new(Queue::new());
        let (done_tx, done) = mpsc::channel();
        let chunk_len = pool.shape().layer_block_bytes() as usize;
        let mut joins = Vec::new();
        for i in 0..thread_count() {
            let (queue, done_tx, pool, engine) = (queue.clone(), done_tx.clone(), pool.clone(), engine.clone());
            let join = std::thread::Builder::new()
                .name(format!("kvflow-payload{i}"))
                .spawn(move || {
                    lower_priority();
                    let mut chunk = vec![0u8; chunk_len];
                    while let Some((tag, work, handed)) = queue.pop() {
                        let done = run(&pool, &mut chunk, tag, work, handed, &engine);
                        if done_tx.send(done).is_err() {
                            return;
                        }
                        engine.unpark();
                    }
                })
                .context("a payload thread")?;
            joins.push(join);
        }
        Ok(Workers { queue, done, joins })
    }

    /// Hands `work` over; its [`Done`] carries `tag`.
    pub(super) fn submit(&self, tag: T, work: Work) {
        self.queue.push(tag, work);
    }

    /// The next piece of work done, if any.
    pub(super) fn try_done(&self) -> Option<Done<T>> {
        self.done.try_recv().ok()
    }
}

impl<T> Drop for Workers<T> {
    fn drop(&mut self) {
        self.queue.close();
        for join in self.joins.drain(..) {
            let _ = join.join();
        }
    }
}

/// Puts the calling thread behind the engine's control plane and its ranks' transfers for
/// the CPU. A GPU engine computes and checks on the GPU, not on the cores its control plane
/// and UCX run on; here the payload threads share a few cores with them. At the same priority
/// a prompt's fill stood in the way of every report, free and readiness behind it; at nice 10
/// the scheduler still ran them for whole slices of 5 to 9 ms while a rank's thread waited with
/// a transfer to post (traced with `sched_switch` on 2 cores). So they run as `SCHED_IDLE`,
/// which gets a core only when no other thread wants it, or at nice 10 where that is refused.
/// Linux applies either to the calling thread alone; failing is harmless (the work is done all
/// the same), so it is only logged.
#[allow(unsafe_code)] // Two libc calls: see the SAFETY notes.
pub(crate) fn lower_priority() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler reads the parameter it is given and changes no memory of this
    // process; 0 names the calling thread.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) } == 0 {
        return;
    }
    // SAFETY: setpriority takes plain integers and changes no memory of this process.
    let result = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 10) };
    if result != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "payload thread keeps its priority");
    }
}

/// Called by a payload thread before each copy to or from the pool (a layer of a block on a
/// rank: 64 KiB in the default layout, a few µs): gives the core to any thread waiting for it.
/// `SCHED_IDLE` alone does not: EEVDF let a payload thread that had just woken the engine's
/// thread run on for 4.3 ms, to the next tick, while the engine's thread waited on the same
/// core for its lag to be paid (traced with `sched_switch` on 2 cores), and such waits were
/// most of the demo's P done -> D holds KV tail. Stepping aside between blocks (0.1 to 0.3 ms
/// of work each) left waits of that length: in 5 runs each, alternated, 24 requests over 2.3
/// times their transfer with it and 13 stepping aside at each copy. The attacker's flooding
/// threads, at the same priority, step aside through it too, between connections.
pub(crate) fn step_aside() {
    std::thread::yield_now();
}

/// Runs `work` on a thread of its own at the payload threads' priority ([`lower_priority`]),
/// and returns what it gave: an engine's start-up work that would otherwise hold a core from
/// the control plane of the engines already running (a restarted D's pool, zeroed page by
/// page: 0.3 s of one core for the demo's 768 MiB).
pub(super) fn at_low_priority<R: Send>(work: impl FnOnce() -> R + Send) -> R {
    std::thread::scope(|scope| {
        let thread = scope.spawn(|| {
            lower_priority();
            work()
        });
        thread.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

fn run<T>(pool: &PoolBytes, chunk: &mut [u8], tag: T, work: Work, handed: Instant, engine: &Thread) -> Done<T> {
    let (mut written_after_free, mut intact, mut model) = (0, true, None);
    let result = match work {
        Work::Fill { seed, blocks, freed, first } => pool.written_after_free(chunk, &freed).and_then(|written| {
            written_after_free = written;
            pool.fill(chunk, seed, &blocks, first)
        }),
        Work::Check { seed, blocks, tokens } => pool.check(chunk, seed, &blocks, tokens).map(|all| intact = all),
        Work::Scrub { blocks } => pool.scrub(chunk, &blocks),
        Work::Compute { prompt, blocks, freed, from, to, chunk: tokens, layers_of } => {
            pool.written_after_free(chunk, &freed).and_then(|written| {
                written_after_free = written;
                let layers_of = layers_of.as_deref();
                model = pool.compute(&prompt, &blocks, (from, to), tokens, layers_of, engine)?.map(ModelOut::First);
                Ok(())
            })
        }
        Work::Decode { blocks, prompt_tokens, first, count } => {
            pool.decode(&blocks, prompt_tokens, first, count).map(|generated| {
                model = Some(ModelOut::Generated(generated));
            })
        }
    };
    let failed = result.err().map(|e| format!("{e:#}"));
    Done { tag, written_after_free, intact, handed, failed, model }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue() -> Queue<&'static str> {
        Queue::new()
    }

    #[test]
    fn a_load_s_work_goes_before_the_checks_of_loads_done_and_everything_runs_before_the_end() {
        let queue = queue();
        queue.push("check 1", Work::Check { seed: 1, blocks: vec![BlockId(0)], tokens: 16 });
        queue.push("scrub", Work::Scrub { blocks: vec![BlockId(1)] });
        queue.push("check 2", Work::Check { seed: 2, blocks: vec![BlockId(2)], tokens: 16 });
        queue.push("prepare", Work::Fill { seed: 3, blocks: Vec::new(), freed: vec![BlockId(3)], first: 0 });
        queue.close();
        let order: Vec<&str> = std::iter::from_fn(|| queue.pop()).map(|(tag, _, _)| tag).collect();
        assert_eq!(order, ["scrub", "prepare", "check 1", "check 2"]);
    }

    #[test]
    fn a_thread_waiting_for_work_wakes_for_it_and_ends_when_closed() {
        let queue = Arc::new(queue());
        let worker = {
            let queue = queue.clone();
            std::thread::spawn(move || std::iter::from_fn(|| queue.pop()).map(|(tag, _, _)| tag).collect::<Vec<_>>())
        };
        queue.push("scrub", Work::Scrub { blocks: vec![BlockId(1)] });
        queue.close();
        assert_eq!(worker.join().unwrap(), ["scrub"]);
    }
}
