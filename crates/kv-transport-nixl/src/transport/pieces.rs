//! Transfers between host memory posted in pieces.
//!
//! Between two processes on one host, UCX moves host memory over its shared-memory transports,
//! and NIXL's post of a read or write copies the bytes inside the call: 10 to 14 ms for 16 to
//! 32 MiB on 2 cores. A rank's thread posts its transfers one after another, so a small load
//! that arrived meanwhile waited the whole copy behind a large one (the demo's P done -> D
//! holds KV p99 was 13 to 17 times the small load's own transfer). So a transfer of more than
//! [`crate::NixlConfig::post_piece_bytes`] between host memory on both sides goes as several
//! NIXL requests, posted while they may go until [`crate::NixlConfig::post_piece_budget`] has
//! passed and the rest at the next polls of the transfer: what the rank's thread was asked for
//! in between is posted between two pieces. The budget is a round's, not a call's: the polls
//! and posts of one turn of the engine's loop (each transfer polled once) share it, the oldest
//! transfer first, so a turn with several large transfers in flight also returns to the
//! engine's loop within about one budget ([`Round`]). Where posts return at once (a NIC moves
//! the bytes) every piece goes in the first call. The notification goes with the last
//! piece, posted only once every other piece has ended, so the peer is told only after every
//! byte moved. A piece that fails stops the rest; the transfer
//! reports the failure once the pieces in flight have ended, so no byte lands after it is
//! reported. Device memory is posted whole: its copies do not run inside the post.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use kv_core::{AgentName, PreparedId, TransferId, TransferOp, TransferStatus, TransportError};
use nixl_sys::{MemType, XferRequest};

use super::{backend_error, descriptor_list, xfer_op, NixlTransport, Pending};
use crate::metadata::TypedRanges;

/// The bytes of one piece, by default. Over UCX's shared memory the copy runs in the kernel
/// (`process_vm_readv`), which on a kernel without preemption holds the core for the whole of
/// one piece: about 100 µs for 1 MiB, 400 to 550 µs for 4 MiB (traced with `sched_switch`),
/// while a thread woken on that core waits. Each piece costs a NIXL request, which costs the
/// one-at-a-time 32 MiB pull nothing measurable: 12.41 GB/s with 1 MiB pieces and a 250 µs
/// budget against 12.5 with 4 MiB and 500 µs (two runs each; earlier, posted one piece a poll,
/// 4 MiB pieces ran at 9.8 to 11.9 and 16 MiB at 13.5 to 13.8). See
/// [`DEFAULT_POST_PIECE_BUDGET`] for what the pair did to the demo's tail.
pub const DEFAULT_POST_PIECE_BYTES: u64 = 1 << 20;

/// How long one turn of the engine's loop may go on posting pieces, by default: where a post
/// copies inline (UCX's shared memory) that is two or three pieces, and where posts return at
/// once (a NIC moves the bytes) every piece goes in the first call, so pieces cost such a
/// transport nothing. A rank takes up the commands sent to it only between turns, so the
/// budget bounds how long a new load waits for its rank: in the demo on 2 cores, with 4 MiB
/// pieces and 500 µs, D's engine-to-rank hand-off of a load had a p99 of 0.9 to 2.0 ms (turns
/// of up to 1.9 ms, traced) and the largest hop of about half the requests whose P done -> D
/// holds KV exceeded 2.5 times their transfer; with 1 MiB and 250 µs its p99 was 0.35 to 0.51
/// ms. The default demo's pull `kv_over_transfer` p99 went from a median of 3.0 (8 runs) to
/// 2.14 (19 runs, all at most 2.50); 1 MiB pieces with 500 µs gave 2.95 (11 runs).
pub const DEFAULT_POST_PIECE_BUDGET: Duration = Duration::from_micros(250);

/// The posting that one turn of the engine's loop shares: pieces go while they may until the
/// budget has passed since the round began, and at least one does. A round ends when a
/// transfer it polled is polled again (a driver polls each transfer once a turn, oldest first;
/// a caller that polls one transfer in a loop gets a round a call), or once nothing touched it
/// for a budget (an engine idle between two posts). In the demo on 2 cores, a D rank with
/// three large reads in flight held its core for 1.3 ms a turn when each poll had a budget of
/// its own (traced with `sched_switch`), while a thread woken on that core waited for it.
#[derive(Debug)]
pub(crate) struct Round {
    began: Instant,
    touched: Instant,
    posted: bool,
    polled: Vec<TransferId>,
}

impl Round {
    /// The round that a poll of transfer `id` at `now` (or a new transfer's first post)
    /// belongs to: `current`, unless it polled `id` already or lay idle for `budget`.
    pub(crate) fn next(current: Option<Round>, id: TransferId, now: Instant, budget: Duration) -> Round {
        match current {
            Some(round) if now.saturating_duration_since(round.touched) < budget && !round.polled.contains(&id) => {
                round
            }
            _ => Round { began: now, touched: now, posted: false, polled: Vec::new() },
        }
    }

    /// Whether another piece may go at `now`: none went yet this round, or `budget` has not
    /// passed since it began.
    pub(crate) fn may_post(&self, now: Instant, budget: Duration) -> bool {
        !self.posted || now.saturating_duration_since(self.began) < budget
    }

    /// Transfer `id` was polled (or posted) in this round, which ended that at `now`.
    pub(crate) fn touch(&mut self, id: TransferId, now: Instant) {
        self.polled.push(id);
        self.touched = now;
    }
}

/// One piece of a transfer: what one NIXL request moves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Piece {
    /// Address pairs.
    Pairs(Vec<Span>),
    /// Entries of prepared lists `lists` (local, remote), paired in order.
    Entries { lists: (PreparedId, PreparedId), local: Vec<u32>, remote: Vec<u32> },
}

/// One address pair of a piece: local and remote start, length, and each side's device id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Span {
    pub(crate) local: u64,
    pub(crate) remote: u64,
    pub(crate) len: u64,
    pub(crate) local_device: u64,
    pub(crate) remote_device: u64,
}

/// A transfer in pieces, as [`crate::NixlTransport`] tracks it.
pub(crate) struct Pieced {
    pub(crate) op: TransferOp,
    pub(crate) peer: AgentName,
    /// Pieces not posted yet, in order.
    pub(crate) waiting: VecDeque<Piece>,
    /// What the peer is told when the last piece ends (sealed when that piece is posted).
    pub(crate) notification: Option<Vec<u8>>,
    pub(crate) in_flight: Vec<XferRequest>,
    /// The first failure: nothing more is posted.
    pub(crate) failed: Option<TransportError>,
}

impl Pieced {
    /// Whether the next piece may be posted now: none failed, and, for the last piece of a
    /// transfer with a notification, every other piece has ended.
    pub(crate) fn may_post(&self) -> bool {
        let held = self.waiting.len() == 1 && self.notification.is_some() && !self.in_flight.is_empty();
        self.failed.is_none() && !self.waiting.is_empty() && !held
    }

    /// Whether the transfer has ended: nothing in flight, and nothing left to post or a
    /// failure.
    pub(crate) fn ended(&self) -> bool {
        self.in_flight.is_empty() && (self.waiting.is_empty() || self.failed.is_some())
    }
}

impl NixlTransport {
    /// Tracks a transfer in `pieces` under a new id, and posts its first piece.
    pub(super) fn start_pieces(
        &mut self,
        op: TransferOp,
        peer: AgentName,
        pieces: Vec<Piece>,
        notification: Option<Vec<u8>>,
    ) -> TransferId {
        let waiting = pieces.into();
        let mut pieced = Pieced { op, peer, waiting, notification, in_flight: Vec::new(), failed: None };
        let id = self.new_id();
        self.advance_in_round(id, &mut pieced);
        self.transfers.insert(id, Pending::Pieces(Box::new(pieced)));
        id
    }

    /// Takes in and posts the pieces of transfer `id` within the round its poll belongs to.
    fn advance_in_round(&mut self, id: TransferId, pieced: &mut Pieced) {
        let mut round = Round::next(self.piece_round.take(), id, Instant::now(), self.piece_budget);
        self.advance(pieced, &mut round);
        round.touch(id, Instant::now());
        self.piece_round = Some(round);
    }

    /// Polls the pieces of transfer `id` in flight, posts its next piece if it may go, and
    /// says where the transfer stands.
    pub(super) fn poll_pieces(&mut self, id: TransferId) -> TransferStatus {
        let Some(Pending::Pieces(mut pieced)) = self.transfers.remove(&id) else {
            return TransferStatus::Failed(TransportError::UnknownTransfer(id));
        };
        self.advance_in_round(id, &mut pieced);
        if !pieced.ended() {
            self.transfers.insert(id, Pending::Pieces(pieced));
            return TransferStatus::InProgress;
        }
        match pieced.failed {
            Some(e) => TransferStatus::Failed(e),
            None => TransferStatus::Done,
        }
    }

    /// Takes in which of `pieced`'s pieces in flight ended, and posts the next ones while they
    /// may go and `round` has budget left (`NixlConfig::post_piece_budget` since it began; its
    /// first piece goes whatever the budget).
    fn advance(&self, pieced: &mut Pieced, round: &mut Round) {
        loop {
            let failed = &mut pieced.failed;
            pieced.in_flight.retain(|xfer| match self.status_of(xfer) {
                TransferStatus::InProgress => true,
                TransferStatus::Done => false,
                TransferStatus::Failed(e) => {
                    failed.get_or_insert(e);
                    false
                }
            });
            if !pieced.may_post() || !round.may_post(Instant::now(), self.piece_budget) {
                return;
            }
            self.post_next_piece(pieced);
            round.posted = true;
        }
    }

    /// Posts the next piece of `pieced` (it may go); the last carries the notification.
    fn post_next_piece(&self, pieced: &mut Pieced) {
        let piece = pieced.waiting.pop_front().expect("may_post: one waits");
        let notification = if pieced.waiting.is_empty() { pieced.notification.as_deref() } else { None };
        match self.post_piece(pieced, &piece, notification) {
            Ok(xfer) => pieced.in_flight.push(xfer),
            Err(e) => pieced.failed = Some(e),
        }
    }

    fn post_piece(
        &self,
        pieced: &Pieced,
        piece: &Piece,
        notification: Option<&[u8]>,
    ) -> Result<XferRequest, TransportError> {
        let args = self.transfer_args(&pieced.peer, notification)?;
        let xfer = match piece {
            Piece::Pairs(spans) => {
                let peer =
                    self.peers.get(&pieced.peer).ok_or_else(|| TransportError::UnknownPeer(pieced.peer.clone()))?;
                let list =
                    |ranges: Vec<(u64, u64, u64)>| descriptor_list(&TypedRanges { mem_type: MemType::Dram, ranges });
                let local = list(spans.iter().map(|s| (s.local, s.len, s.local_device)).collect())?;
                let remote = list(spans.iter().map(|s| (s.remote, s.len, s.remote_device)).collect())?;
                self.agent
                    .create_xfer_req(xfer_op(pieced.op), &local, &remote, &peer.nixl, Some(&args))
                    .map_err(|e| backend_error("create transfer", e))?
            }
            Piece::Entries { lists: (l, r), local, remote } => {
                let lists = (self.prepared.get(*l, None)?, self.prepared.get(*r, Some(&pieced.peer))?);
                self.make_entries(pieced.op, lists, (local, remote), &args)?
            }
        };
        self.agent.post_xfer_req(&xfer, Some(&args)).map_err(|e| backend_error("post transfer", e))?;
        Ok(xfer)
    }
}

/// `spans` cut into pieces of at most `max` bytes each, in order, a span cut where a piece
/// fills up.
pub(crate) fn split_spans(spans: impl IntoIterator<Item = Span>, max: u64) -> Vec<Piece> {
    let max = max.max(1);
    let mut pieces = Vec::new();
    let (mut piece, mut filled) = (Vec::new(), 0u64);
    for mut span in spans {
        while span.len > 0 {
            let take = span.len.min(max - filled);
            piece.push(Span { len: take, ..span });
            (span.local, span.remote, span.len) = (span.local + take, span.remote + take, span.len - take);
            filled += take;
            if filled == max {
                pieces.push(Piece::Pairs(std::mem::take(&mut piece)));
                filled = 0;
            }
        }
    }
    if !piece.is_empty() {
        pieces.push(Piece::Pairs(piece));
    }
    pieces
}

/// Entry pairs `local[i]`, `remote[i]` of prepared `lists` grouped into pieces of at most `max`
/// bytes, in order, `len` giving each local entry's bytes; an entry larger than `max` is a
/// piece of its own.
pub(crate) fn split_entries(
    lists: (PreparedId, PreparedId),
    local: &[u32],
    remote: &[u32],
    len: impl Fn(u32) -> u64,
    max: u64,
) -> Vec<Piece> {
    let mut pieces = Vec::new();
    let (mut l, mut r, mut filled) = (Vec::new(), Vec::new(), 0u64);
    for (&a, &b) in local.iter().zip(remote) {
        let bytes = len(a);
        if !l.is_empty() && filled + bytes > max {
            pieces.push(Piece::Entries { lists, local: std::mem::take(&mut l), remote: std::mem::take(&mut r) });
            filled = 0;
        }
        l.push(a);
        r.push(b);
        filled += bytes;
    }
    if !l.is_empty() {
        pieces.push(Piece::Entries { lists, local: l, remote: r });
    }
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(local: u64, remote: u64, len: u64) -> Span {
        Span { local, remote, len, local_device: 0, remote_device: 0 }
    }

    fn spans(piece: &Piece) -> Vec<(u64, u64, u64)> {
        match piece {
            Piece::Pairs(spans) => spans.iter().map(|s| (s.local, s.remote, s.len)).collect(),
            Piece::Entries { .. } => panic!("entries"),
        }
    }

    #[test]
    fn spans_are_cut_where_a_piece_fills_up_and_cover_every_byte_once_in_order() {
        let pieces = split_spans([span(0, 1000, 5), span(100, 2000, 12), span(200, 3000, 3)], 8);
        let got: Vec<_> = pieces.iter().map(spans).collect();
        assert_eq!(
            got,
            vec![vec![(0, 1000, 5), (100, 2000, 3)], vec![(103, 2003, 8)], vec![(111, 2011, 1), (200, 3000, 3)],]
        );
        // A transfer within one piece stays whole.
        assert_eq!(split_spans([span(0, 0, 8)], 8).len(), 1);
        assert!(split_spans([], 8).is_empty());
    }

    #[test]
    fn the_polls_of_one_turn_share_a_round_and_its_budget() {
        let (t0, budget, ms) = (Instant::now(), Duration::from_micros(500), Duration::from_millis);
        let us = Duration::from_micros;
        let mut round = Round::next(None, TransferId(1), t0, budget);
        assert!(round.may_post(t0, budget));
        round.posted = true;
        round.touch(TransferId(1), t0 + us(400));
        // Another transfer polled in the same turn: the same round, with what is left of it.
        let mut round = Round::next(Some(round), TransferId(2), t0 + us(410), budget);
        assert!(round.may_post(t0 + us(450), budget));
        assert!(!round.may_post(t0 + us(500), budget), "the budget is the round's, not the call's");
        round.touch(TransferId(2), t0 + us(600));
        // A new transfer's first post in that turn: still spent.
        let round = Round::next(Some(round), TransferId(5), t0 + us(610), budget);
        assert!(!round.may_post(t0 + us(610), budget));
        // The next turn polls transfer 1 again: a new round, whose first piece goes.
        let round = Round::next(Some(round), TransferId(1), t0 + us(620), budget);
        assert!(round.may_post(t0 + ms(5), budget), "a round that posted nothing posts one piece");
        // A round nothing touched for a budget is over, even for a transfer it did not poll.
        let mut round = Round::next(None, TransferId(3), t0, budget);
        round.posted = true;
        round.touch(TransferId(3), t0);
        let round = Round::next(Some(round), TransferId(4), t0 + ms(1), budget);
        assert!(!round.posted && round.polled.is_empty());
        // A zero budget posts one piece a round.
        let mut round = Round::next(None, TransferId(6), t0, Duration::ZERO);
        assert!(round.may_post(t0, Duration::ZERO));
        round.posted = true;
        assert!(!round.may_post(t0, Duration::ZERO));
    }

    #[test]
    fn entries_are_grouped_up_to_the_piece_size_and_a_large_one_stands_alone() {
        let len = |i: u32| if i == 3 { 20 } else { 4 };
        let lists = (PreparedId(1), PreparedId(2));
        let pieces = split_entries(lists, &[0, 1, 2, 3, 4, 5], &[9, 8, 7, 6, 5, 4], len, 8);
        let entries = |local: Vec<u32>, remote: Vec<u32>| Piece::Entries { lists, local, remote };
        assert_eq!(
            pieces,
            vec![
                entries(vec![0, 1], vec![9, 8]),
                entries(vec![2], vec![7]),
                entries(vec![3], vec![6]),
                entries(vec![4, 5], vec![5, 4])
            ]
        );
    }
}
