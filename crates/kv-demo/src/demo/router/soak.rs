//! A soak (`cargo xtask soak`): traffic goes on until the soak's time is up, every minute one
//! process is stopped in turn (see [`SoakFault`]), and every few seconds each engine
//! process's resident memory, open descriptors and `kvflow_blocks_held` are sampled.

use super::*;
use crate::demo::config::{Pause, SoakPlan};
use crate::prometheus::{self, Exposition};

/// When the first fault falls after traffic begins, and the faults' period: faults fall
/// between whole minutes, so that an engine's minute-2 sample is not taken mid-fault.
const FIRST_FAULT: Duration = Duration::from_secs(30);
const FAULT_EVERY: Duration = Duration::from_secs(60);

/// How long a sample waits for an engine's metrics.
const SAMPLE_SCRAPE_TIMEOUT: Duration = Duration::from_secs(2);

/// The faults, in turn: every process is stopped, and each incarnation of P and of the
/// killed D lives four minutes. P is killed last, so that a 4-minute soak's first P lives
/// three and a half and its growth is checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SoakFault {
    /// The last D engine killed with SIGKILL, restarted half a second later.
    KillDecode,
    /// decode0 stopped with SIGSTOP past the lease (1.5 leases), then resumed.
    StopDecode0,
    /// P killed with SIGKILL (in push mode right after posting a write), restarted.
    KillPrefill,
    /// The last D engine stopped as decode0 is.
    StopDecode,
}

const TURNS: [SoakFault; 4] =
    [SoakFault::KillDecode, SoakFault::StopDecode0, SoakFault::StopDecode, SoakFault::KillPrefill];

/// A soak in progress: its plan, when it ends, the faults made, and the samples taken.
pub(in crate::demo) struct Soak {
    pub(in crate::demo) plan: SoakPlan,
    started: Instant,
    ends: Instant,
    next_fault: Instant,
    /// Faults made: seconds after traffic began, and what.
    pub(in crate::demo) faults: Vec<(f64, String)>,
    next_sample: Instant,
    pub(in crate::demo) samples: Vec<SoakSample>,
}

/// One sample of one engine process.
#[derive(Clone, Debug, PartialEq)]
pub(in crate::demo) struct SoakSample {
    /// `engine#instance`.
    pub(in crate::demo) incarnation: String,
    /// Seconds after traffic began.
    pub(in crate::demo) at_s: f64,
    /// `VmRSS`, in KiB.
    pub(in crate::demo) rss_kib: u64,
    /// Entries of `/proc/PID/fd`.
    pub(in crate::demo) fds: u64,
    /// `kvflow_blocks_held` over its ranks (`None` while it is stopped, or if its metrics
    /// did not answer).
    pub(in crate::demo) blocks_held: Option<u64>,
}

impl Soak {
    pub(in crate::demo) fn new(plan: SoakPlan, started: Instant) -> Soak {
        Soak {
            plan,
            started,
            ends: started + Duration::from_secs(u64::from(plan.minutes) * 60),
            next_fault: started + FIRST_FAULT,
            faults: Vec::new(),
            next_sample: started,
            samples: Vec::new(),
        }
    }
}

/// A process's resident memory in KiB and its open descriptors; `None` if it is gone.
fn rss_and_fds(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss = status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?.trim().trim_end_matches("kB").trim();
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64;
    Some((rss.parse().ok()?, fds))
}

impl Demo {
    /// Whether the soak's traffic still goes on at `now`.
    pub(super) fn soaking(&self, now: Instant) -> bool {
        self.soak.as_ref().is_some_and(|s| now < s.ends)
    }

    /// Samples the engines when a sample is due, and makes the next fault when it is due and
    /// the one before has settled (the killed engine is back, nothing is stopped).
    pub(super) fn soak_step(&mut self, now: Instant) -> Result<()> {
        let Some(soak) = &self.soak else { return Ok(()) };
        if now >= soak.next_sample {
            self.soak_sample(now);
        }
        let Some(soak) = &self.soak else { return Ok(()) };
        let due = now >= soak.next_fault && now < soak.ends;
        if !due || self.restarting() || self.paused.is_some() || !self.pauses.is_empty() {
            return Ok(());
        }
        let turn = TURNS[soak.faults.len() % TURNS.len()];
        let at_s = now.duration_since(soak.started).as_secs_f64();
        let what = self.soak_fault(turn)?;
        let soak = self.soak.as_mut().expect("soaking");
        soak.faults.push((at_s, what));
        soak.next_fault += FAULT_EVERY;
        Ok(())
    }

    /// Makes fault `turn`; says what it did.
    fn soak_fault(&mut self, turn: SoakFault) -> Result<String> {
        let stop = |engine: String| Pause {
            engine,
            at_issued: 0,
            length: Duration::from_millis(self.config.lease_ms * 3 / 2),
        };
        match turn {
            SoakFault::KillDecode => {
                self.past_kills.extend(self.kill.take());
                self.kill_decode()?;
                Ok(format!("killed {} with SIGKILL", self.victim()))
            }
            SoakFault::StopDecode0 | SoakFault::StopDecode => {
                let engine = if turn == SoakFault::StopDecode0 { "decode0".to_owned() } else { self.victim() };
                let pause = stop(engine.clone());
                let what = format!("stopped {engine} with SIGSTOP for {} ms", pause.length.as_millis());
                self.pauses.push_back(Pause { at_issued: self.issued, ..pause });
                Ok(what)
            }
            SoakFault::KillPrefill => {
                self.past_p_kills.extend(self.p_kill.take());
                if self.config.push {
                    // With a write in flight, as `--kill-prefill` does.
                    self.kill_prefill();
                    return Ok("killed prefill0 with SIGKILL right after a push write".into());
                }
                self.scrape("prefill0");
                let node = self.nodes.get_mut("prefill0").expect("started");
                node.child.kill().context("cannot kill prefill0")?;
                let _ = node.child.wait();
                let instance = node.instance;
                // Dead already: the kill's progress restarts it.
                let phase = PKillPhase::Dying(Instant::now());
                self.p_kill = Some(PKill { instance, at_ns: 0, phase, mid_write: false });
                Ok("killed prefill0 with SIGKILL".into())
            }
        }
    }

    /// Samples every engine process running (stopped ones too, whose metrics are not asked).
    pub(super) fn soak_sample(&mut self, now: Instant) {
        let Some(soak) = &self.soak else { return };
        let at_s = now.duration_since(soak.started).as_secs_f64();
        let stopped = self.paused.as_ref().map(|(p, ..)| p.engine.clone());
        let mut samples = Vec::new();
        for (name, node) in self.nodes.iter().filter(|(_, n)| n.port.is_some()) {
            let Some((rss_kib, fds)) = rss_and_fds(node.child.id()) else { continue };
            let blocks_held = node
                .metrics
                .filter(|_| stopped.as_deref() != Some(name.as_str()))
                .and_then(|addr| prometheus::scrape(addr, SAMPLE_SCRAPE_TIMEOUT).ok())
                .and_then(|text| Exposition::parse(&text).ok())
                .map(|e| e.sum(kv_sched_adapter::metrics::BLOCKS_HELD, &[]) as u64);
            let incarnation = super::super::metrics::incarnation(name, node.instance);
            samples.push(SoakSample { incarnation, at_s, rss_kib, fds, blocks_held });
        }
        let soak = self.soak.as_mut().expect("soaking");
        soak.samples.extend(samples);
        soak.next_sample = now + soak.plan.sample_every;
    }
}
