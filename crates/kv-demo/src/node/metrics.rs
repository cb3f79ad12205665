//! The engine's metrics endpoint (`kvflow-node --metrics-addr`): the connectors' counters,
//! gauges and histograms (kv-sched-adapter's `metrics` module, through the `metrics` facade)
//! recorded by `metrics-exporter-prometheus`'s recorder and served in Prometheus's text format
//! by kv-engine's [`MetricsEndpoint`] (at most `MAX_CONNECTIONS` held: idle peers are evicted
//! past it and cannot delay a scrape), with the listeners' counts set at each scrape.

use std::net::SocketAddr;
use std::sync::{Mutex, PoisonError};

use anyhow::Result;
use kv_core::side::admission::Stage;
use kv_core::RefusalCause;
use kv_engine::metrics::{install_recorder, MetricsEndpoint};
use kv_transport_nixl::SideProbe;
use kv_transport_tcp::TcpProbe;

/// A rank's listeners, read at each scrape: the side channel's, and the TCP transport's data
/// listener when it runs that transport.
pub(super) enum Listeners {
    /// NIXL: the side channel only (UCX's own listener is UCX's).
    Side(SideProbe),
    /// The TCP transport: its side channel and its data listener.
    Tcp(TcpProbe),
}

/// Connections refused by the engine's listeners, by listener and cause.
pub const CONNECTIONS_REFUSED: &str = "kvflow_connections_refused_total";
/// Connections waiting to authenticate, by listener and stage.
pub const CONNECTIONS_PENDING: &str = "kvflow_connections_pending";
/// Data frames refused for a tag their link's session did not make.
pub const FRAMES_FORGED: &str = "kvflow_data_frames_forged_total";

/// Every rank's listeners this process watches, with the engine's name and the rank.
static WATCHED: Mutex<Vec<(String, u32, Listeners)>> = Mutex::new(Vec::new());

/// Has the metrics endpoint report `listeners` of `engine`'s rank `rank` from now on.
pub(super) fn watch(engine: &str, rank: u32, listeners: Listeners) {
    WATCHED.lock().unwrap_or_else(PoisonError::into_inner).push((engine.to_owned(), rank, listeners));
}

/// Sets the listeners' metrics from their statuses (counters as absolute values).
fn record_listeners() {
    let watched = WATCHED.lock().unwrap_or_else(PoisonError::into_inner);
    for (engine, rank, listeners) in watched.iter() {
        let (side, data) = match listeners {
            Listeners::Side(probe) => (probe.status(), None),
            Listeners::Tcp(probe) => (probe.side(), Some(probe.data())),
        };
        let record = |listener: &'static str, refused: [u64; RefusalCause::ALL.len()], pending: [usize; 3]| {
            for cause in RefusalCause::ALL {
                let labels = [
                    ("engine", engine.clone()),
                    ("rank", rank.to_string()),
                    ("listener", listener.to_owned()),
                    ("cause", cause.as_str().to_owned()),
                ];
                metrics::counter!(CONNECTIONS_REFUSED, &labels).absolute(refused[cause.index()]);
            }
            for stage in Stage::ALL {
                let labels = [
                    ("engine", engine.clone()),
                    ("rank", rank.to_string()),
                    ("listener", listener.to_owned()),
                    ("stage", stage.as_str().to_owned()),
                ];
                metrics::gauge!(CONNECTIONS_PENDING, &labels).set(pending[stage as usize] as f64);
            }
        };
        record("side", side.refused_by_cause, side.pending_by_stage);
        if let Some(data) = data {
            record("data", data.refused_by_cause, data.pending_by_stage);
            let labels = [("engine", engine.clone()), ("rank", rank.to_string())];
            metrics::counter!(FRAMES_FORGED, &labels).absolute(data.frames_forged);
        }
    }
}

/// Installs the process's metrics recorder (with the connectors' histogram buckets and
/// descriptions) and serves `GET /metrics` at `addr` until the endpoint is dropped. The
/// connectors take their metric handles when they are built: call this before any scheduler or
/// worker is, and once per process.
pub(super) fn serve(addr: SocketAddr) -> Result<MetricsEndpoint> {
    let handle = install_recorder()?;
    metrics::describe_counter!(
        CONNECTIONS_REFUSED,
        "connections the engine's listeners (side channel, TCP data listener) closed before they authenticated, displaced ones included, by cause"
    );
    metrics::describe_gauge!(CONNECTIONS_PENDING, "connections waiting to authenticate, by listener and stage");
    metrics::describe_counter!(FRAMES_FORGED, "TCP data frames refused for a tag their link's session did not make");
    Ok(MetricsEndpoint::serve(addr, move || {
        // The recorder's housekeeping (histogram windows), at each scrape.
        handle.run_upkeep();
        record_listeners();
        handle.render()
    })?)
}
