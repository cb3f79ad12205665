//! Unit tests of the prefill worker; the scenarios and random seeds of kv-testkit drive the rest of it.

use kv_core::{PeerAddress, Role, Time};

use crate::common::test_offer;
use crate::{PrefillError, PrefillEvent, PrefillScheduler};

use super::*;

fn worker() -> PrefillWorker {
    let (pool, offer) = test_offer("prefill0", Role::Prefill, 1);
    PrefillWorker::new(offer, Config::default(), pool).unwrap()
}

fn scheduler(config: Config) -> PrefillScheduler {
    PrefillScheduler::new(&test_offer("prefill0", Role::Prefill, 1).1, vec![PeerAddress("p0".into())], config).unwrap()
}

fn reports(worker: &mut PrefillWorker) -> Vec<PrefillReport> {
    std::iter::from_fn(|| worker.poll_action())
        .filter_map(|a| match a {
            Action::Report(report) => Some(report),
            _ => None,
        })
        .collect()
}

#[test]
fn an_id_named_by_a_freed_export_is_refused_and_a_worker_that_still_remembers_it_releases_it_at_once() {
    let config = Config::default();
    let mut scheduler = scheduler(config);
    let mut worker = worker();
    let r1 = RequestId::new("r1");
    let carry = |scheduler: &mut PrefillScheduler, worker: &mut PrefillWorker, now: Time| {
        while let Some(event) = scheduler.poll_event() {
            match event {
                PrefillEvent::ToWorker { command, .. } => worker.handle_command(now, command),
                PrefillEvent::Free { request, blocks, reason } => return Some((request, blocks, reason)),
            }
        }
        None
    };
    scheduler
        .handle_finished(Time::ZERO, r1.clone(), vec![BlockId(1), BlockId(2)], Prompt::len_only(32), None)
        .unwrap();
    assert_eq!(carry(&mut scheduler, &mut worker, Time::ZERO), None);
    // Nobody claims it: the lease runs out and every rank (the one) releases it.
    let expiry = Time::ZERO + config.kv_lease_duration;
    worker.handle_timeout(expiry);
    for report in reports(&mut worker) {
        scheduler.handle_report(0, report).unwrap();
    }
    let freed = carry(&mut scheduler, &mut worker, expiry);
    assert_eq!(freed, Some((r1.clone(), vec![BlockId(1), BlockId(2)], ReleaseReason::Expired)));

    // The scheduler refuses the id: the engine keeps its blocks and hears why.
    let again =
        scheduler.handle_finished(expiry, r1.clone(), vec![BlockId(3)], Prompt::len_only(16), None).unwrap_err();
    assert_eq!(again.to_string(), "request r1 was exported or given up before; a request id names one export");
    assert_eq!(scheduler.handle_progress(r1.clone(), vec![BlockId(3)], None), Err(PrefillError::Reused(r1.clone())));
    assert_eq!(scheduler.pending(), 0);

    // A worker that is handed such an export anyway (a scheduler that forgot the id first)
    // releases it at once instead of dropping it: the scheduler would wait for ever.
    let deadline = expiry + config.kv_lease_duration;
    let prompt = Prompt::len_only(16);
    let (request, blocks) = (r1.clone(), vec![BlockId(3)]);
    let export = PrefillCommand::Export { request, blocks, deadline, consumer: None, prompt, transfer: None };
    worker.handle_command(expiry, export);
    assert_eq!(reports(&mut worker), vec![PrefillReport::Released { request: r1, reason: ReleaseReason::Aborted }]);
    assert_eq!(worker.book().exports, 0);
}

#[test]
fn a_push_prompt_given_up_keeps_its_id_but_a_pull_one_does_not() {
    for mode in [Mode::Push, Mode::Pull] {
        let config = Config { mode, ..Config::default() };
        let mut scheduler = scheduler(config);
        let mut worker = worker();
        let r1 = RequestId::new("r1");
        scheduler.handle_progress(r1.clone(), vec![BlockId(1)], None).unwrap();
        scheduler.handle_abandoned(r1.clone()).unwrap();
        while let Some(event) = scheduler.poll_event() {
            if let PrefillEvent::ToWorker { command, .. } = event {
                worker.handle_command(Time::ZERO, command);
            }
        }
        for report in reports(&mut worker) {
            scheduler.handle_report(0, report).unwrap();
        }
        let again =
            scheduler.handle_finished(Time::ZERO, r1.clone(), vec![BlockId(1), BlockId(2)], Prompt::len_only(32), None);
        match mode {
            // The workers told D none will come and take late messages for the old attempt.
            Mode::Push => assert_eq!(again, Err(PrefillError::Reused(r1))),
            // Nothing reached a worker: the engine may compute the prompt again under its id.
            Mode::Pull => assert!(again.is_ok(), "{again:?}"),
        }
    }
}

/// In push mode P asks for its own list and a D rank's as soon as that rank connects, so the
/// first write to it names blocks by index like every other; pull mode writes nothing.
#[test]
fn push_prepares_the_descriptor_lists_when_a_d_rank_connects_not_at_its_first_write() {
    let prepares = |mode: Mode| {
        let (pool, offer) = test_offer("prefill0", Role::Prefill, 1);
        let mut p = PrefillWorker::new(offer, Config { mode, ..Config::default() }, pool).unwrap();
        let (_, handshake) = test_offer("decode0", Role::Decode, 1);
        let info = kv_core::PeerInfo {
            agent: AgentName::new(handshake.engine.clone(), 0),
            handshake,
            sent_at: Time::ZERO,
            received_at: Time::ZERO,
            dialed: None,
        };
        p.handle_peer_event(Time::ZERO, PeerEvent::Connected(Box::new(info)));
        std::iter::from_fn(|| p.poll_action())
            .filter_map(|a| match a {
                Action::Prepare { peer, ranges, .. } => Some((peer.map(|p| p.to_string()), ranges.len())),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    let (pool, _) = test_offer("prefill0", Role::Prefill, 1);
    let entries = pool.shape.block_descriptors(&pool.regions.iter().map(|r| r.addr).collect::<Vec<_>>()).len();
    assert_eq!(prepares(Mode::Push), vec![(None, entries), (Some("decode0/tp0".to_owned()), entries)]);
    assert_eq!(prepares(Mode::Pull), Vec::new());
}

/// What `run` logs at WARNING and above, as text.
fn warnings_of(run: impl FnOnce()) -> String {
    use std::sync::{Arc, Mutex};
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Lines {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let lines = Lines::default();
    let writer = lines.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, run);
    let text = lines.0.lock().unwrap().clone();
    String::from_utf8(text).unwrap()
}

#[test]
fn expired_leases_are_logged_at_warning_a_few_a_window_naming_request_and_engine() {
    let config = Config::default();
    let mut worker = worker();
    let expiry = Time::ZERO + config.kv_lease_duration;
    let export = |worker: &mut PrefillWorker, now: Time, i: u32| {
        let command = PrefillCommand::Export {
            request: RequestId::new(format!("r{i}")),
            blocks: vec![BlockId(i)],
            deadline: now + config.kv_lease_duration,
            consumer: None,
            prompt: Prompt::len_only(16),
            transfer: None,
        };
        worker.handle_command(now, command);
    };
    let logged = warnings_of(|| {
        for i in 0..8 {
            export(&mut worker, Time::ZERO, i);
        }
        worker.handle_timeout(expiry);
    });
    let lines: Vec<&str> = logged.lines().filter(|l| l.contains("its lease expired")).collect();
    assert_eq!(lines.len(), crate::warnings::PER_WINDOW as usize, "{logged}");
    assert!(lines.iter().all(|l| l.contains("WARN") && l.contains("engine=prefill0/tp0")), "{logged}");
    assert!(lines[0].contains("request=r0") && lines[0].contains("left_out=0"), "{lines:?}");
    // The next window's first line says how many the last one left out.
    let later = expiry + crate::warnings::WINDOW;
    let logged = warnings_of(|| {
        export(&mut worker, later, 8);
        worker.handle_timeout(later + config.kv_lease_duration);
    });
    assert!(logged.contains("request=r8") && logged.contains("left_out=3"), "{logged}");
}
