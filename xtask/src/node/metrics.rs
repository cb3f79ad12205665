//! The engine's metrics endpoint (`kvflow-node --metrics-addr`): the connectors' counters,
//! gauges and histograms (kv-sched-adapter's `metrics` module, through the `metrics` facade)
//! recorded by `metrics-exporter-prometheus`'s recorder and served in Prometheus's text format
//! by [`crate::prometheus::serve`], on a listener and a thread of their own.

use std::net::{SocketAddr, TcpListener};

use anyhow::{Context, Result};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};

/// Binds `addr`, installs the process's metrics recorder (with the connectors' histogram
/// buckets and descriptions), and serves `GET /metrics` on a thread of its own; returns the
/// port it listens on. The connectors take their metric handles when they are built: call
/// this before any scheduler or worker is, and once per process.
pub(super) fn serve(addr: SocketAddr) -> Result<u16> {
    let listener = TcpListener::bind(addr).with_context(|| format!("cannot listen for metrics on {addr}"))?;
    let port = listener.local_addr().with_context(|| format!("the metrics listener on {addr}"))?.port();
    let mut builder = PrometheusBuilder::new();
    for (name, buckets) in kv_sched_adapter::metrics::HISTOGRAM_BUCKETS {
        builder = builder
            .set_buckets_for_metric(Matcher::Full((*name).to_owned()), buckets)
            .with_context(|| format!("the buckets of {name}"))?;
    }
    let handle = builder.install_recorder().context("cannot install the metrics recorder")?;
    kv_sched_adapter::metrics::describe();
    std::thread::Builder::new()
        .name("kvflow-metrics".into())
        .spawn(move || {
            crate::prometheus::serve(listener, || {
                // The recorder's housekeeping (histogram windows), at each scrape.
                handle.run_upkeep();
                handle.render()
            })
        })
        .context("the metrics endpoint's thread")?;
    Ok(port)
}
