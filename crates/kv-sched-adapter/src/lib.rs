//! The connector an engine calls: P and D, scheduler side and worker side, pull and push.
//!
//! Everything here except [`driver`] is sans-IO: state machines that take `now` and inputs
//! through `handle_*` methods and hand back what to do through `poll_*` methods, as
//! quinn-proto does. They read no clock and touch no socket, so the simulator, the tests, the
//! demo and an engine all run this same code.
//!
//! The scheduler side of one request, P to D, as it runs (the workers, which move the bytes
//! over a transport, get the `ToWorker` commands; kv-demo's `pull_pair` examples run the whole
//! pair over the fake transport, NIXL and TCP):
//!
//! ```
//! use kv_core::{
//!     AgentName, BlockId, EngineId, KvLayout, PeerAddress, PoolShape, Prompt, RegionBase, RequestId, Role, Time,
//! };
//! use kv_sched_adapter::{Config, DecodeCommand, DecodeEvent, DecodeScheduler, LocalPool, PrefillScheduler};
//!
//! let config = Config::default(); // or `Config::from_extra` with vLLM's kv_connector_extra_config
//! // P's one rank: its pool, and the handshake offer that names the engine and its incarnation
//! // (given here, once; the scheduler takes both from the offer).
//! let shape = PoolShape::new(KvLayout::llama3_8b(16), 8, 64)?;
//! let pool = LocalPool { shape, regions: vec![RegionBase { addr: 0x1000_0000, len: shape.pool_bytes() }] };
//! let offer = pool.offer(&AgentName::new(EngineId::new("prefill0"), 0), 1, 1, Role::Prefill, "llama-3-8b");
//! let address = PeerAddress("10.0.0.1:5600".into());
//! let mut p = PrefillScheduler::new(&offer, vec![address], config)?;
//! let mut d = DecodeScheduler::new(EngineId::new("decode0"), 1, config)?;
//!
//! // P finished a 40-token prompt in its blocks 7, 8 and 9: the router hands D what P returns.
//! // (P's ranks lend the blocks only to a claim that names this prompt.)
//! let request = RequestId::new("req-1");
//! let prompt = Prompt::of_tokens(&[1; 40]);
//! let remote = p.handle_finished(Time::ZERO, request.clone(), vec![BlockId(7), BlockId(8), BlockId(9)], prompt, None)?;
//! assert_eq!(remote.export.as_ref().map(|e| e.blocks.len()), Some(3));
//!
//! // D admits it with its own prompt, then gives it blocks 0, 1 and 2: its worker is told to
//! // load the KV.
//! d.handle_arrive(request.clone(), remote, prompt)?;
//! d.handle_schedule(request.clone(), vec![BlockId(0), BlockId(1), BlockId(2)], false)?;
//! let commands: Vec<DecodeCommand> = std::iter::from_fn(|| d.poll_event())
//!     .filter_map(|e| match e {
//!         DecodeEvent::ToWorker { command, .. } => Some(command),
//!         _ => None,
//!     })
//!     .collect();
//! assert!(matches!(commands.last(), Some(DecodeCommand::Load { blocks, .. }) if blocks.len() == 3));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Engines are built as a scheduler and one worker per TP rank, and so is the connector:
//!
//! - [`PrefillScheduler`] exports a finished request ([`PrefillScheduler::handle_finished`]
//!   returns the [`RemoteRef`] the router hands D) and frees its blocks once every rank has
//!   released it ([`PrefillEvent::Free`], with the [`ReleaseReason`]).
//! - [`PrefillWorker`] keeps each export's lease on its rank and releases it exactly once.
//! - [`DecodeScheduler`] admits ([`DecodeScheduler::handle_arrive`]), schedules, rejects and
//!   aborts requests, and says when their KV is ready or their blocks may be freed.
//! - [`DecodeWorker`] renews P's leases, fences and posts reads (or registers for a push),
//!   and tells P when it is done.
//!
//! The engine carries scheduler events to workers (`ToWorker`) and worker reports back
//! (`Action::Report`). The drive loop of a worker, after every input and at every wake-up,
//! drains its actions in order, then sleeps until its next timeout:
//!
//! ```no_run
//! # use kv_sched_adapter::*;
//! # fn transport_step(_: &Action<PrefillReport>) {}
//! # fn now() -> kv_core::Time { kv_core::Time::ZERO }
//! # fn sleep_until(_: Option<kv_core::Time>) {}
//! # let mut worker: PrefillWorker = unimplemented!();
//! # let mut scheduler: PrefillScheduler = unimplemented!();
//! loop {
//!     worker.handle_timeout(now()); // a spurious wake-up is a no-op
//!     while let Some(action) = worker.poll_action() {
//!         match action {
//!             Action::Report(report) => scheduler.handle_report(0, report).unwrap(),
//!             other => transport_step(&other), // connect, send, post: see `driver`
//!         }
//!     }
//!     sleep_until(worker.poll_timeout());
//! }
//! ```
//!
//! [`driver::WorkerDriver`] does exactly this over any [`kv_core::Transport`].
//!
//! # Calling it from an engine
//!
//! Prefill engine, at the moments the engine already has:
//!
//! | engine moment | call |
//! |---|---|
//! | start-up | the settings: `Config` from the engine's `kv_connector_extra_config` ([`ExtraConfig`], serde with the `serde` feature), validated; `PrefillScheduler::new(&offer, rank_addresses, config)?`, any rank's offer (below): the engine and its incarnation are the offer's, given once |
//! | start-up, per rank | the handshake offer from the rank's pool ([`LocalPool::offer`]), a transport with it; `PrefillWorker::new(offer, config, pool)?` (an offer that does not describe the pool, or unsound settings, fail here, naming the values); wrap both in a `WorkerDriver` |
//! | a chunked prefill finishes a chunk (optional) | `PrefillScheduler::handle_progress(id, blocks_so_far, consumer)`: in push mode the workers write the finished blocks into those D registered while the rest computes; from then on the blocks are the connector's until the export or `Free` |
//! | a chunk computed layer by layer finishes a layer (optional) | `PrefillScheduler::handle_layer_progress(id, blocks_so_far, LayerProgress { whole, layers }, consumer)`: as `handle_progress`, and in push mode the workers write each computed layer of the chunk in progress, so that at the export only the last layer of the last chunk is left to move; `layers: 0` reports a chunk about to be computed (its blocks are the connector's from then on), as vLLM's connector does before each step |
//! | the engine gives such a request up before it finishes | `PrefillScheduler::handle_abandoned(id)`; free the blocks it reported at the `Free` that follows (reason `aborted`, once no write from them is in flight), the others at once |
//! | a request finishes its prompt | `PrefillScheduler::handle_finished(now, id, blocks, prompt_tokens, consumer)` (`consumer`: the D engine the router already chose, if it did); hand the returned [`RemoteRef`] to the router (with the `serde` feature, one JSON object, as vLLM's `kv_transfer_params` carry it) |
//! | every scheduler step | drain `PrefillScheduler::poll_event`: give `ToWorker` commands to the rank's driver (`WorkerDriver::command(now, command)`, which carries out what the worker asks at once; its reports go to `handle_report`), free the blocks of `Free` |
//! | every worker step, per rank | `WorkerDriver::step(now)`; give each report to `PrefillScheduler::handle_report(rank, report)` |
//! | after the router aborts a finished request | nothing: the export ends by its own rules |
//!
//! Decode engine:
//!
//! | engine moment | call |
//! |---|---|
//! | start-up | `DecodeScheduler::new(engine, tp, config)?`, and per rank `DecodeWorker::new(pool.offer(..), config, pool)?` in a `WorkerDriver` |
//! | a request with P's [`RemoteRef`] enters the waiting queue | `DecodeScheduler::handle_arrive(id, remote)` |
//! | blocks are allocated for it | `DecodeScheduler::handle_schedule(id, blocks, prefix_hit)`, or `handle_schedule_cached(id, blocks, cached_blocks)` when its own prefix cache holds the first blocks (vLLM's locally computed tokens): only the rest are read |
//! | it is rejected before admission | `DecodeScheduler::handle_reject(id, remote)` |
//! | the router aborts it | `DecodeScheduler::handle_abort(&id)` |
//! | every step | `WorkerDriver::step(now)` per rank, reports to `handle_report(rank, report)`; drain `DecodeScheduler::poll_event` (`ToWorker` to the rank's `WorkerDriver::command(now, command)`, reports to `handle_report`; `Ready`: the KV is in place; `Free`: the load failed or was aborted, no transfer touches the blocks any more, the request is [`DecodeState::Failed`], [`DecodeState::Recompute`] (its first `kept_blocks` hold valid KV: compute from there) or [`DecodeState::Gone`]) |
//!
//! kv-testkit's `cluster` module is a complete engine of both kinds over the in-memory
//! transport, and reads as a worked example; kv-demo's `pull_pair` examples are the smallest
//! pair, one engine code over the fake transport, NIXL and TCP.
//!
//! # Metrics
//!
//! With the `metrics` feature the schedulers and [`driver::WorkerDriver`] record what they count
//! through the `metrics` facade: releases by reason, exports and blocks held, ignored messages
//! by cause, transfers, bytes and times, the KV-ready latency, stranded block-seconds
//! ([`metrics::METRICS`] lists them). Install the engine's recorder before building them.
//!
//! # Decisions beyond vLLM
//!
//! Decisions the simulator forced, beyond vLLM's behaviour:
//!
//! - A heartbeat's acknowledgement says, per request, whether P holds the export (with its
//!   deadline), released it, or does not know it yet (P's workers learn of exports a step
//!   late); D treats only `released` as final.
//! - An export a D engine has renewed or registered for is bound to it, and a sibling's
//!   completion does not release it: that engine may be reading it. D reads a sibling's export
//!   only after P has acknowledged holding it, so P can never free a sibling under a read.
//! - A second handshake from the same agent name is a new incarnation: P treats the old one as
//!   lost, releasing what was bound to it and dropping what it had staged.
//! - Handshakes and [`RemoteRef`]s name P's incarnation: D never loads an export from a P
//!   incarnation other than the one that made it (a restarted P's pool holds other blocks).
//! - `decoder_kv_blocks_ttl` bounds everything D holds for a peer: a request that waits
//!   longer than it unscheduled is given up (the load-failure policy) and P told, so it
//!   cannot hold P's blocks for ever; and it is the default `push_registration_timeout`, after
//!   which D gives up the blocks it registered for a push that never came (vLLM's bidirectional
//!   meaning). Scenarios `decoder-ttl-bounds-renewals-of-a-waiting-request` and
//!   `push-decoder-ttl-is-the-watchdog` check both.
//! - A parent whose sibling was transferred is remembered for one lease and at most 8192 of
//!   them, the oldest forgotten first (seed 002's bound is the count alone): a sibling that
//!   registers while it is remembered is released at once, a later one waits for its own
//!   lease (scenario `pulled-parent-remembered-one-lease`). Time-bounded memories are pruned
//!   before every registration as well as at wake-ups, so a worker that slept through the
//!   horizon does not act on them.
//! - In pull mode an abort from one of the owner's D ranks counts as that rank being done
//!   with the blocks, as its completion would: P frees them once every consumer rank is
//!   done, since the owner's other ranks may still be reading them (one rank's read failed
//!   part-way while the others read on: scenario `one-rank-aborts-while-the-others-read`).
//! - A push "no write will come" that D did not ask for fails the load but does not end its
//!   quarantine: it may answer an earlier cancel of the same id, taken in late. D cancels and
//!   waits for the answer to that (scenario `push-stale-no-write-answer-is-not-trusted`).
//! - A request id names one export. P's workers remember a released id for two leases, to
//!   tell late messages about it from early ones, so [`PrefillScheduler::handle_finished`]
//!   and [`PrefillScheduler::handle_progress`] refuse an id whose export (or push prompt
//!   given up) was freed, among the last 65 536 ([`PrefillError::Reused`]); a worker handed
//!   one all the same releases it at once (`aborted`), so its blocks never strand. A pull
//!   prompt given up reached no worker, and may be computed again under its id.
//! - Push registrations that come before P's prefill stay staged until
//!   `push_registration_timeout`, when D's watchdog gives up on them anyway.

mod common;
mod config;
mod decode;
pub mod driver;
#[cfg(feature = "serde")]
mod handoff;
pub mod metrics;
mod prefill;
mod warnings;

pub use common::{Action, Consumer, Counters, ExportInfo, LocalPool, PrefillEngine, RemoteRef, XferToken};
pub use config::{
    Config, ConfigError, ExtraConfig, Ignored, KvRole, KvTransferConfig, LoadFailurePolicy, Mode, ReleaseReason,
    SettingDoc, UnknownKeys, ABORT_TIMEOUT_ENV, EXTRA_SETTINGS, TRANSFER_SETTINGS,
};
pub use decode::{
    DecodeCommand, DecodeError, DecodeEvent, DecodeReport, DecodeScheduler, DecodeState, DecodeWorker, LoadOutcome,
};
#[cfg(feature = "serde")]
pub use handoff::{
    vouched_bytes, Arrival, BlockIds, HandoffError, HandoffRefusal, LayoutNote, TransferParams, HANDOFF_VERSION,
    HANDOFF_VOUCH_LABEL, MAX_HANDOFF_BLOCKS, MAX_HANDOFF_TP,
};
pub use prefill::{
    LayerProgress, PrefillBook, PrefillCommand, PrefillError, PrefillEvent, PrefillReport, PrefillScheduler,
    PrefillWorker, MAX_PAIRINGS,
};
