//! Starving P of CPU while a key holder floods it: busy threads on P's core, as the busy
//! engines beside a real P are (vLLM's engine core and workers on the same host), and the
//! flood sent from the other cores, as a key holder on another host sends with CPU of its own.
//!
//! A hog on every core alike starves the flooder as much as P, and P kept up: on 2 cores,
//! with two or four busy threads a core in the attacker's process, P grew by 30 to 44 MiB
//! under the flood before P had a drainer (bound 64). With P's threads confined to one core
//! beside four busy threads and the flooder on the other, the same flood grew it by 165 MiB.
//! So the contended flood confines P to core 0 with [`Hog::THREADS`] busy threads there, keeps
//! the attacker's flooding thread off it, and gives both their cores back afterwards.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use anyhow::{anyhow, Result};

/// Which cores a thread may run on, as `sched_setaffinity` takes them.
#[derive(Clone, Copy)]
struct Cores(libc::cpu_set_t);

impl Cores {
    /// The cores thread `tid` may run on (0: the calling thread).
    #[allow(unsafe_code)] // One libc call: see the SAFETY note.
    fn of(tid: libc::pid_t) -> std::io::Result<Cores> {
        // SAFETY: an all-zero cpu_set_t is the empty set; sched_getaffinity writes at most
        // size_of::<cpu_set_t>() bytes into it.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: see above; `set` lives across the call.
        if unsafe { libc::sched_getaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &mut set) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Cores(set))
    }

    /// Core `core` alone, or every core of `all` but it.
    #[allow(unsafe_code)] // CPU_ZERO, CPU_SET, CPU_CLR: bit operations on a set we own.
    fn only(core: usize, all: &Cores, but: bool) -> Cores {
        let mut set = all.0;
        // SAFETY: `set` is a valid cpu_set_t and `core` is below CPU_SETSIZE (checked by the
        // callers: a core this machine has).
        unsafe {
            if but {
                libc::CPU_CLR(core, &mut set);
            } else {
                libc::CPU_ZERO(&mut set);
                libc::CPU_SET(core, &mut set);
            }
        }
        Cores(set)
    }

    #[allow(unsafe_code)] // CPU_COUNT reads a set we own.
    fn count(&self) -> usize {
        // SAFETY: `self.0` is a valid cpu_set_t.
        unsafe { libc::CPU_COUNT(&self.0) as usize }
    }

    #[allow(unsafe_code)] // CPU_ISSET reads a set we own.
    fn first(&self) -> Option<usize> {
        // SAFETY: `self.0` is a valid cpu_set_t; every index is below CPU_SETSIZE.
        (0..libc::CPU_SETSIZE as usize).find(|&c| unsafe { libc::CPU_ISSET(c, &self.0) })
    }

    /// Confines thread `tid` (0: the calling thread) to these cores.
    #[allow(unsafe_code)] // One libc call: see the SAFETY note.
    fn apply(&self, tid: libc::pid_t) -> std::io::Result<()> {
        // SAFETY: `self.0` is a valid cpu_set_t of the size given; the call reads it only.
        if unsafe { libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &self.0) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
}

/// The threads of process `pid`, by id.
fn threads_of(pid: u32) -> Vec<libc::pid_t> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|dir| dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect())
        .unwrap_or_default()
}

/// P confined to one core beside busy threads, and the calling thread kept off that core,
/// until it is dropped, which stops the busy threads and gives everyone their cores back.
pub(super) struct Hog {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    /// P's process, and the cores it had.
    p: (u32, Cores),
    /// The cores the calling thread had.
    caller: Cores,
    /// P's core.
    pub(super) core: usize,
}

impl Hog {
    /// Busy threads on P's core.
    pub(super) const THREADS: usize = 4;

    /// Confines every thread of process `p_pid` to the first core it may use, starts
    /// [`Hog::THREADS`] busy threads there, and keeps the calling thread (and the threads it
    /// starts from now on: a NIXL agent's progress thread, say) off it. Fails on a machine of
    /// one core, where P cannot be starved more than its flooder.
    pub(super) fn start(p_pid: u32) -> Result<Hog> {
        let p_cores = Cores::of(p_pid as libc::pid_t).map_err(|e| anyhow!("P's cores: {e}"))?;
        let caller = Cores::of(0).map_err(|e| anyhow!("the attacker's cores: {e}"))?;
        let core = p_cores.first().ok_or_else(|| anyhow!("P may run on no core"))?;
        let others = Cores::only(core, &caller, true);
        if others.count() == 0 {
            return Err(anyhow!("the attacker has no core but P's ({core}): the contended flood needs two"));
        }
        let hog_core = Cores::only(core, &p_cores, false);
        let mut hog =
            Hog { stop: Arc::new(AtomicBool::new(false)), threads: Vec::new(), p: (p_pid, p_cores), caller, core };
        others.apply(0).map_err(|e| anyhow!("keeping the attacker off core {core}: {e}"))?;
        for tid in threads_of(p_pid) {
            // A thread that ended meanwhile cannot be confined, and needs not be.
            let _ = hog_core.apply(tid);
        }
        for _ in 0..Self::THREADS {
            let stop = hog.stop.clone();
            hog.threads.push(std::thread::spawn(move || {
                let _ = hog_core.apply(0);
                // Work a compiler cannot take away, checked for the stop now and then.
                let mut x = 0x9e37_79b9_7f4a_7c15u64;
                while !stop.load(Ordering::Relaxed) {
                    for _ in 0..10_000 {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                    }
                    std::hint::black_box(x);
                }
            }));
        }
        Ok(hog)
    }

    fn release(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
        for tid in threads_of(self.p.0) {
            let _ = self.p.1.apply(tid);
        }
        let _ = self.caller.apply(0);
    }
}

impl Drop for Hog {
    fn drop(&mut self) {
        self.release();
    }
}
