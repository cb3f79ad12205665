//! Tensor-parallel mapping: which P ranks a D rank reads, which heads, and how many
//! completions each P rank waits for.
//!
//! With `d_tp >= p_tp`, D rank `r` reads P rank `r * p_tp / d_tp`, the head slice that `r`
//! owns, and each P rank waits for `d_tp / p_tp` completions. With `p_tp > d_tp`, D rank `r`
//! reads P ranks `r*k .. r*k + k - 1` (`k = p_tp / d_tp`), one head slice from each, and each P
//! rank waits for one completion. MLA replicates its latent on every rank: D reads one P rank
//! and notifies the others it maps to, so that they free too.

use serde::{Deserialize, Serialize};

/// A TP combination kvflow refuses at handshake.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum TpError {
    /// A TP size is zero.
    #[error("tensor-parallel size is 0 (prefill {prefill_tp}, decode {decode_tp})")]
    ZeroTp {
        /// P's TP size.
        prefill_tp: u32,
        /// D's TP size.
        decode_tp: u32,
    },
    /// Neither TP size divides the other.
    #[error("tensor-parallel sizes do not divide: prefill {prefill_tp}, decode {decode_tp}")]
    NotDivisible {
        /// P's TP size.
        prefill_tp: u32,
        /// D's TP size.
        decode_tp: u32,
    },
    /// The KV heads cannot be spread evenly over a TP size.
    #[error("{kv_heads} kv heads do not shard over {side} tp {tp}")]
    HeadsNotDivisible {
        /// `"prefill"` or `"decode"`.
        side: &'static str,
        /// That side's TP size.
        tp: u32,
        /// The model's KV heads.
        kv_heads: u32,
    },
    /// P replicates KV heads (`p_tp > kv_heads`) and is wider than D.
    #[error("prefill tp {prefill_tp} replicates {kv_heads} kv heads and is wider than decode tp {decode_tp}")]
    ReplicatedKvWiderPrefill {
        /// P's TP size.
        prefill_tp: u32,
        /// D's TP size.
        decode_tp: u32,
        /// The model's KV heads.
        kv_heads: u32,
    },
    /// A rank is not below its TP size.
    #[error("{side} rank {rank} is out of range for tp {tp}")]
    RankOutOfRange {
        /// `"prefill"` or `"decode"`.
        side: &'static str,
        /// The rank asked for.
        rank: u32,
        /// The TP size.
        tp: u32,
    },
}

/// A validated P/D TP combination for one model.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct TpMapping {
    prefill_tp: u32,
    decode_tp: u32,
    kv_heads: u32,
    mla: bool,
}

/// Heads that D reads from one P rank: a run of P's heads into a run of D's.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct HeadSlice {
    /// The P rank read.
    pub prefill_rank: u32,
    /// First head of the run within the P rank's shard.
    pub prefill_head: u32,
    /// First head of the run within the D rank's shard.
    pub decode_head: u32,
    /// Heads in the run.
    pub heads: u32,
}

/// What one D rank does for a request: the reads it posts and the P ranks it only notifies.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct DecodeRankPlan {
    /// One read per P rank read, with its head slice.
    pub reads: Vec<HeadSlice>,
    /// P ranks this D rank does not read but must notify so they free (MLA with P wider).
    pub notify_only: Vec<u32>,
}

impl DecodeRankPlan {
    /// Every P rank this D rank sends a completion to: those it reads, then those it only notifies.
    pub fn completion_targets(&self) -> impl Iterator<Item = u32> + '_ {
        self.reads.iter().map(|r| r.prefill_rank).chain(self.notify_only.iter().copied())
    }

    /// The plan against a P engine of `stages` pipeline stages, each `prefill_tp` ranks wide
    /// and holding its share of the layers: every read and notification once per stage, P
    /// ranks numbered globally (`stage * prefill_tp + tp rank`), stage by stage. A D rank then
    /// sends `stages` times as many completions, and each P rank still waits for
    /// [`TpMapping::consumers_per_prefill_rank`] of them.
    pub fn across_stages(&self, stages: u32, prefill_tp: u32) -> DecodeRankPlan {
        let global = |stage: u32, rank: u32| stage * prefill_tp + rank;
        DecodeRankPlan {
            reads: (0..stages)
                .flat_map(|stage| {
                    self.reads.iter().map(move |r| HeadSlice { prefill_rank: global(stage, r.prefill_rank), ..*r })
                })
                .collect(),
            notify_only: (0..stages)
                .flat_map(|stage| self.notify_only.iter().map(move |&r| global(stage, r)))
                .collect(),
        }
    }
}

impl TpMapping {
    /// Validates a TP combination for a model with `kv_heads` KV heads (ignored for MLA).
    pub fn new(prefill_tp: u32, decode_tp: u32, kv_heads: u32, mla: bool) -> Result<Self, TpError> {
        if prefill_tp == 0 || decode_tp == 0 {
            return Err(TpError::ZeroTp { prefill_tp, decode_tp });
        }
        if prefill_tp % decode_tp != 0 && decode_tp % prefill_tp != 0 {
            return Err(TpError::NotDivisible { prefill_tp, decode_tp });
        }
        let kv_heads = if mla { 1 } else { kv_heads };
        if !mla {
            for (side, tp) in [("prefill", prefill_tp), ("decode", decode_tp)] {
                if kv_heads == 0 || (kv_heads % tp != 0 && tp % kv_heads != 0) {
                    return Err(TpError::HeadsNotDivisible { side, tp, kv_heads });
                }
            }
            if prefill_tp > kv_heads && prefill_tp > decode_tp {
                return Err(TpError::ReplicatedKvWiderPrefill { prefill_tp, decode_tp, kv_heads });
            }
        }
        Ok(TpMapping { prefill_tp, decode_tp, kv_heads, mla })
    }

    /// P's TP size.
    pub fn prefill_tp(&self) -> u32 {
        self.prefill_tp
    }

    /// D's TP size.
    pub fn decode_tp(&self) -> u32 {
        self.decode_tp
    }

    /// The signed ratio vLLM reports: `d_tp / p_tp` when D is at least as wide, else `-(p_tp / d_tp)`.
    pub fn tp_ratio(&self) -> i64 {
        if self.decode_tp >= self.prefill_tp {
            i64::from(self.decode_tp / self.prefill_tp)
        } else {
            -i64::from(self.prefill_tp / self.decode_tp)
        }
    }

    /// Completions each P rank waits for before it frees an export.
    pub fn consumers_per_prefill_rank(&self) -> u32 {
        (self.decode_tp / self.prefill_tp).max(1)
    }

    /// KV heads held by each P rank.
    pub fn prefill_heads(&self) -> u32 {
        heads_per_rank(self.kv_heads, self.prefill_tp, self.mla)
    }

    /// KV heads held by each D rank.
    pub fn decode_heads(&self) -> u32 {
        heads_per_rank(self.kv_heads, self.decode_tp, self.mla)
    }

    /// The reads and notifications of D rank `rank`.
    pub fn decode_rank(&self, rank: u32) -> Result<DecodeRankPlan, TpError> {
        if rank >= self.decode_tp {
            return Err(TpError::RankOutOfRange { side: "decode", rank, tp: self.decode_tp });
        }
        let (p, d) = (self.prefill_tp, self.decode_tp);
        if d >= p {
            let prefill_rank = rank * p / d;
            let heads = self.decode_heads();
            let prefill_head = if self.mla { 0 } else { self.first_head(rank, d) - self.first_head(prefill_rank, p) };
            let read = HeadSlice { prefill_rank, prefill_head, decode_head: 0, heads };
            return Ok(DecodeRankPlan { reads: vec![read], notify_only: Vec::new() });
        }
        let k = p / d;
        let ranks = rank * k..rank * k + k;
        if self.mla {
            let read = HeadSlice { prefill_rank: rank * k, prefill_head: 0, decode_head: 0, heads: 1 };
            return Ok(DecodeRankPlan { reads: vec![read], notify_only: ranks.skip(1).collect() });
        }
        let heads = self.prefill_heads();
        let reads = ranks
            .map(|prefill_rank| HeadSlice {
                prefill_rank,
                prefill_head: 0,
                decode_head: self.first_head(prefill_rank, p) - self.first_head(rank, d),
                heads,
            })
            .collect();
        Ok(DecodeRankPlan { reads, notify_only: Vec::new() })
    }

    /// The D ranks that send P rank `rank` a completion; their count is what it waits for.
    pub fn consumers_of_prefill_rank(&self, rank: u32) -> Result<Vec<u32>, TpError> {
        if rank >= self.prefill_tp {
            return Err(TpError::RankOutOfRange { side: "prefill", rank, tp: self.prefill_tp });
        }
        let (p, d) = (self.prefill_tp, self.decode_tp);
        Ok(if d >= p {
            let t = d / p;
            (rank * t..rank * t + t).collect()
        } else {
            vec![rank / (p / d)]
        })
    }

    /// The model-wide index of the first head that `rank` of a `tp`-wide engine holds.
    fn first_head(&self, rank: u32, tp: u32) -> u32 {
        if tp <= self.kv_heads {
            rank * (self.kv_heads / tp)
        } else {
            rank / (tp / self.kv_heads)
        }
    }
}

fn heads_per_rank(kv_heads: u32, tp: u32, mla: bool) -> u32 {
    if mla {
        1
    } else {
        (kv_heads / tp).max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(prefill_rank: u32, prefill_head: u32, decode_head: u32, heads: u32) -> HeadSlice {
        HeadSlice { prefill_rank, prefill_head, decode_head, heads }
    }

    /// One row: (p_tp, d_tp, kv_heads, mla, d_rank, expected reads, expected notify-only, consumers per P rank).
    type Row = (u32, u32, u32, bool, u32, Vec<HeadSlice>, Vec<u32>, u32);

    fn check(row: Row) {
        let (p, d, k, mla, rank, reads, notify_only, consumers) = row;
        let mapping = TpMapping::new(p, d, k, mla).unwrap();
        let plan = mapping.decode_rank(rank).unwrap();
        let what = format!("p_tp {p} d_tp {d} heads {k} mla {mla} d_rank {rank}");
        assert_eq!(plan.reads, reads, "{what}: reads");
        assert_eq!(plan.notify_only, notify_only, "{what}: notify-only");
        assert_eq!(mapping.consumers_per_prefill_rank(), consumers, "{what}: consumers");
        // Every P rank this D rank targets counts it among its consumers.
        for target in plan.completion_targets() {
            assert!(mapping.consumers_of_prefill_rank(target).unwrap().contains(&rank), "{what}: P {target}");
        }
    }

    #[test]
    fn decode_rank_mapping_table() {
        let rows: Vec<Row> = vec![
            // D TP 2 rank 1 from P TP 2 reads P rank 1, all of its heads.
            (2, 2, 8, false, 1, vec![slice(1, 0, 0, 4)], vec![], 1),
            // D TP 4 rank 2 from P TP 2 reads P rank 1, the first half of its heads; P ranks wait for 2.
            (2, 4, 8, false, 2, vec![slice(1, 0, 0, 2)], vec![], 2),
            (2, 4, 8, false, 3, vec![slice(1, 2, 0, 2)], vec![], 2),
            // D TP 1 from P TP 2 reads P ranks 0 and 1; each waits for 1.
            (2, 1, 8, false, 0, vec![slice(0, 0, 0, 4), slice(1, 0, 4, 4)], vec![], 1),
            // D TP 2 from P TP 4 with 8 heads reads two ranks with a head slice each.
            (4, 2, 8, false, 0, vec![slice(0, 0, 0, 2), slice(1, 0, 2, 2)], vec![], 1),
            (4, 2, 8, false, 1, vec![slice(2, 0, 0, 2), slice(3, 0, 2, 2)], vec![], 1),
            // P TP 4 to D TP 1 (vLLM issue 43523).
            (4, 1, 8, false, 0, (0..4).map(|p| slice(p, 0, 2 * p, 2)).collect(), vec![], 1),
            // D replicates heads (d_tp > heads): pairs of D ranks share a head.
            (4, 16, 8, false, 5, vec![slice(1, 0, 0, 1)], vec![], 4),
            (4, 16, 8, false, 7, vec![slice(1, 1, 0, 1)], vec![], 4),
            // Both replicate, D wider.
            (16, 32, 8, false, 31, vec![slice(15, 0, 0, 1)], vec![], 2),
            // MLA: D wider reads one rank; P wider reads one and notifies the rest.
            (2, 4, 1, true, 3, vec![slice(1, 0, 0, 1)], vec![], 2),
            (4, 2, 1, true, 1, vec![slice(2, 0, 0, 1)], vec![3], 1),
            (4, 1, 1, true, 0, vec![slice(0, 0, 0, 1)], vec![1, 2, 3], 1),
        ];
        for row in rows {
            check(row);
        }
    }

    #[test]
    fn prefill_rank_consumers() {
        let m = TpMapping::new(2, 4, 8, false).unwrap();
        assert_eq!(m.consumers_of_prefill_rank(1).unwrap(), vec![2, 3]);
        let m = TpMapping::new(4, 2, 8, false).unwrap();
        assert_eq!(m.consumers_of_prefill_rank(3).unwrap(), vec![1]);
        assert_eq!(m.tp_ratio(), -2);
        assert_eq!(m.consumers_of_prefill_rank(4), Err(TpError::RankOutOfRange { side: "prefill", rank: 4, tp: 4 }));
    }

    #[test]
    fn refused_combinations_name_the_values() {
        /// (p_tp, d_tp, kv_heads, mla), the error, and text its message must hold.
        type Case = ((u32, u32, u32, bool), TpError, &'static str);
        let cases: Vec<Case> = vec![
            ((3, 2, 8, false), TpError::NotDivisible { prefill_tp: 3, decode_tp: 2 }, "prefill 3, decode 2"),
            ((0, 2, 8, false), TpError::ZeroTp { prefill_tp: 0, decode_tp: 2 }, "prefill 0, decode 2"),
            (
                (16, 4, 8, false),
                TpError::ReplicatedKvWiderPrefill { prefill_tp: 16, decode_tp: 4, kv_heads: 8 },
                "prefill tp 16 replicates 8 kv heads and is wider than decode tp 4",
            ),
            (
                (2, 4, 6, false),
                TpError::HeadsNotDivisible { side: "decode", tp: 4, kv_heads: 6 },
                "6 kv heads do not shard over decode tp 4",
            ),
        ];
        for ((p, d, k, mla), err, text) in cases {
            let got = TpMapping::new(p, d, k, mla).unwrap_err();
            assert_eq!(got, err);
            assert!(got.to_string().contains(text), "{got}");
        }
        // MLA replicates by design, so a wider P is fine.
        assert!(TpMapping::new(16, 4, 8, true).is_ok());
        let m = TpMapping::new(2, 2, 8, false).unwrap();
        assert_eq!(m.decode_rank(2), Err(TpError::RankOutOfRange { side: "decode", rank: 2, tp: 2 }));
    }

    #[test]
    fn pipeline_stages_repeat_each_read_and_notification_per_stage() {
        // MLA with P wider: D rank 0 reads P rank 0 and notifies rank 1, in each of 2 stages.
        let m = TpMapping::new(2, 1, 1, true).unwrap();
        let staged = m.decode_rank(0).unwrap().across_stages(2, 2);
        assert_eq!(staged.reads.iter().map(|r| r.prefill_rank).collect::<Vec<_>>(), [0, 2]);
        assert_eq!(staged.notify_only, [1, 3]);
        assert_eq!(staged.completion_targets().count(), 4, "pp x max(1, p_tp / d_tp) completions");
        assert_eq!(m.decode_rank(0).unwrap().across_stages(1, 2), m.decode_rank(0).unwrap());
    }
}
