//! The connectors' logs follow one request across engines: with `kv_sched_adapter=debug`, every
//! step of a request's life is a line that carries its id and the engine it happened on, on P
//! and on D, so an operator can grep one request out of every engine's log.

use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use kv_testkit::scenario::{run, Scenario};
use tracing_subscriber::fmt::MakeWriter;

/// A log sink the test reads back.
#[derive(Clone, Default)]
struct Sink(Arc<Mutex<Vec<u8>>>);

impl Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Sink {
    type Writer = Sink;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

#[test]
fn one_requests_life_is_followed_by_its_id_across_p_and_d() {
    let sink = Sink::default();
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter("kv_sched_adapter=debug")
        .with_writer(sink.clone())
        .with_ansi(false)
        .finish();
    let file = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scenarios/two-decoders.toml");
    let scenario = Scenario::load(&file).unwrap_or_else(|e| panic!("{e}"));
    let outcome = tracing::subscriber::with_default(subscriber, || run(&scenario, 0));
    assert_eq!(outcome.failure, None);
    let log = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
    let of = |request: &str| -> Vec<&str> {
        log.lines()
            .filter(|l| l.contains(&format!("request_id={request}}}")) || l.contains(&format!("request_id={request} ")))
            .collect()
    };
    let r1 = of("r1");
    for (engine, step) in [
        ("prefill0", "export registered"),
        ("decode0", "load tracked"),
        ("decode0", "reads posted"),
        ("decode0", "load finished"),
        ("prefill0", "completion received"),
        ("prefill0", "export released"),
        ("prefill0", "export freed on every rank"),
    ] {
        assert!(
            r1.iter().any(|l| l.contains(&format!("engine={engine}")) && l.contains(step)),
            "no line of r1 says {step:?} with engine={engine}; r1's lines:\n{}",
            r1.join("\n")
        );
    }
    // r2 went to decode1: none of its lines is decode0's, and r1's none of decode1's.
    assert!(of("r2").iter().any(|l| l.contains("engine=decode1")));
    assert!(!of("r2").iter().any(|l| l.contains("engine=decode0")));
    assert!(!r1.iter().any(|l| l.contains("engine=decode1")));
}
