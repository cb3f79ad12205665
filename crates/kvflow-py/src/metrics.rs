//! kvflow's metrics inside vLLM. The schedulers and ranks record through the `metrics` facade
//! (kv-sched-adapter's `metrics` feature); this module installs, when the native module loads
//! and so before any of them is built, a recorder that keeps each process's values, and hands
//! them out as what changed since the last call (`metrics_delta`). The connector ships those in
//! vLLM's KV connector stats, from the scheduler process and from every worker, and vLLM's own
//! Prometheus endpoint shows them (`kvflow.vllm.KvflowPromMetrics`).
//!
//! One process, one recorder: in an engine whose scheduler and worker share a process, whichever
//! connector asks first gets the change, and nothing is counted twice.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use metrics::{Counter, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use pyo3::prelude::*;

/// Samples one histogram keeps between two calls at most; past them it counts what it dropped.
/// vLLM asks every engine step, so only a stalled engine loop reaches it.
pub const MAX_SAMPLES: usize = 65_536;

/// A histogram's samples since the last call.
#[derive(Default)]
struct Samples {
    values: Mutex<Vec<f64>>,
    dropped: AtomicU64,
}

impl HistogramFn for Samples {
    fn record(&self, value: f64) {
        let mut values = self.values.lock().unwrap_or_else(PoisonError::into_inner);
        if values.len() < MAX_SAMPLES {
            values.push(value);
        } else {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Every metric this process recorded, by key (name and labels).
#[derive(Default)]
struct Store {
    counters: Mutex<HashMap<Key, Arc<AtomicU64>>>,
    gauges: Mutex<HashMap<Key, Arc<AtomicU64>>>,
    histograms: Mutex<HashMap<Key, Arc<Samples>>>,
    /// Each counter's value, and each gauge's bits, at the last call.
    reported: Mutex<HashMap<Key, u64>>,
    reported_gauges: Mutex<HashMap<Key, u64>>,
}

fn handle<T: Default>(map: &Mutex<HashMap<Key, Arc<T>>>, key: &Key) -> Arc<T> {
    let mut map = map.lock().unwrap_or_else(PoisonError::into_inner);
    Arc::clone(map.entry(key.clone()).or_default())
}

/// The recorder: it hands out handles into the process's store.
struct StoreRecorder(Arc<Store>);

impl Recorder for StoreRecorder {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(handle(&self.0.counters, key))
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::from_arc(handle(&self.0.gauges, key))
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::from_arc(handle(&self.0.histograms, key))
    }
}

static STORE: OnceLock<Option<Arc<Store>>> = OnceLock::new();

/// Installs the recorder, once per process; false if the process had another (its metrics then
/// go there, and `metrics_delta` finds none).
pub fn install() -> bool {
    STORE
        .get_or_init(|| {
            let store = Arc::new(Store::default());
            metrics::set_global_recorder(StoreRecorder(Arc::clone(&store))).ok().map(|()| store)
        })
        .is_some()
}

/// A metric's name and labels, as Python takes them.
type Named = (String, Vec<(String, String)>);

fn named(key: &Key) -> Named {
    let labels = key.labels().map(|l| (l.key().to_owned(), l.value().to_owned())).collect();
    (key.name().to_owned(), labels)
}

/// What this process's metrics did since the last call: each counter's increase, each gauge's
/// new value, and each histogram's samples, for those that changed (a histogram past
/// [`MAX_SAMPLES`] drops the rest, with a warning).
#[pyfunction]
#[allow(clippy::type_complexity)]
pub fn metrics_delta() -> (Vec<(Named, u64)>, Vec<(Named, f64)>, Vec<(Named, Vec<f64>)>) {
    let Some(Some(store)) = STORE.get() else { return Default::default() };
    let mut counters = Vec::new();
    {
        let now = store.counters.lock().unwrap_or_else(PoisonError::into_inner);
        let mut reported = store.reported.lock().unwrap_or_else(PoisonError::into_inner);
        for (key, value) in now.iter() {
            let value = value.load(Ordering::Relaxed);
            let before = reported.insert(key.clone(), value).unwrap_or(0);
            if value > before {
                counters.push((named(key), value - before));
            }
        }
    }
    let mut gauges = Vec::new();
    {
        let now = store.gauges.lock().unwrap_or_else(PoisonError::into_inner);
        let mut reported = store.reported_gauges.lock().unwrap_or_else(PoisonError::into_inner);
        for (key, value) in now.iter() {
            let bits = value.load(Ordering::Relaxed);
            if reported.insert(key.clone(), bits) != Some(bits) {
                gauges.push((named(key), f64::from_bits(bits)));
            }
        }
    }
    let mut histograms = Vec::new();
    {
        let now = store.histograms.lock().unwrap_or_else(PoisonError::into_inner);
        for (key, samples) in now.iter() {
            let values = std::mem::take(&mut *samples.values.lock().unwrap_or_else(PoisonError::into_inner));
            let dropped = samples.dropped.swap(0, Ordering::Relaxed);
            if dropped > 0 {
                tracing::warn!(
                    metric = key.name(),
                    dropped,
                    "kvflow kept {MAX_SAMPLES} samples of a histogram and dropped the rest: vLLM asked for none for a while"
                );
            }
            if !values.is_empty() {
                histograms.push((named(key), values));
            }
        }
    }
    (counters, gauges, histograms)
}

/// Every metric the connectors record: name, kind (`counter`, `gauge`, `histogram`), labels
/// besides `engine` (and `rank`, on the ranks'), meaning, and a histogram's bucket bounds.
#[pyfunction]
#[allow(clippy::type_complexity)]
pub fn metric_docs() -> Vec<(&'static str, &'static str, Vec<&'static str>, &'static str, Option<Vec<f64>>)> {
    use kv_sched_adapter::metrics::{HISTOGRAM_BUCKETS, METRICS};
    METRICS
        .iter()
        .map(|m| {
            let buckets = HISTOGRAM_BUCKETS.iter().find(|(name, _)| *name == m.name).map(|(_, b)| b.to_vec());
            (m.name, m.kind, m.labels.to_vec(), m.help, buckets)
        })
        .collect()
}
