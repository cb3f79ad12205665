//! The engine's metrics endpoint: `GET /metrics` in Prometheus's text format, rendered by
//! `metrics-exporter-prometheus`'s recorder (the connectors' counters, gauges and histograms,
//! kv-sched-adapter's `metrics` module), served over hyper on a thread of its own.
//!
//! Not over the exporter's own HTTP listener: it spawns a task for every connection it accepts,
//! with no bound and no deadline on a request's head, so a peer that opens connections and
//! sends nothing grows the engine's tasks and file descriptors for as long as it likes, and
//! can starve the side channel's sockets of descriptors. This one holds at most
//! [`MAX_CONNECTIONS`]; past that it drops the oldest connection that has not sent a whole
//! request (else the oldest), so idle peers never lock a scrape out, and a request's head must
//! arrive within [`HEAD_TIMEOUT`].

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::net::TcpListener;
use tokio::task::AbortHandle;

/// The path scrapes ask for.
pub const PATH: &str = "/metrics";
/// Connections held at once, at most.
pub const MAX_CONNECTIONS: usize = 8;
/// How long a connection may take to send a request's head.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(2);

/// Why the metrics endpoint did not start.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The recorder could not be built or installed (one per process).
    #[error("the metrics recorder: {0}")]
    Recorder(String),
    /// The listener could not be bound, or its thread started.
    #[error("the metrics endpoint on {addr}: {error}")]
    Listen {
        /// Where it was to listen.
        addr: SocketAddr,
        /// What failed.
        error: std::io::Error,
    },
}

/// Installs the process's metrics recorder, with the connectors' histogram buckets and
/// descriptions. Call it once per process, before any scheduler or worker is built: they take
/// their metric handles when they are.
pub fn install_recorder() -> Result<PrometheusHandle, MetricsError> {
    let mut builder = PrometheusBuilder::new();
    for (name, buckets) in kv_sched_adapter::metrics::HISTOGRAM_BUCKETS {
        builder = builder
            .set_buckets_for_metric(Matcher::Full((*name).to_owned()), buckets)
            .map_err(|e| MetricsError::Recorder(format!("the buckets of {name}: {e}")))?;
    }
    let handle = builder.install_recorder().map_err(|e| MetricsError::Recorder(e.to_string()))?;
    kv_sched_adapter::metrics::describe();
    Ok(handle)
}

/// The endpoint, serving until dropped.
pub struct MetricsEndpoint {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    join: Option<JoinHandle<()>>,
}

impl MetricsEndpoint {
    /// Binds `addr` (port 0: any free port) and answers scrapes with `render()`'s text (for
    /// example the recorder's [`PrometheusHandle::render`], after whatever the engine records
    /// at each scrape), on a thread of its own.
    pub fn serve(addr: SocketAddr, render: impl FnMut() -> String + Send + 'static) -> Result<Self, MetricsError> {
        let listen = |error| MetricsError::Listen { addr, error };
        // Bound here, with std, so that the caller may itself be inside an async runtime (an
        // engine's): the endpoint's own runtime lives only on its thread.
        let listener = std::net::TcpListener::bind(addr).map_err(listen)?;
        listener.set_nonblocking(true).map_err(listen)?;
        let bound = listener.local_addr().map_err(listen)?;
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(listen)?;
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let render = Arc::new(Mutex::new(render));
        let join = std::thread::Builder::new()
            .name("kvflow-metrics".into())
            .spawn(move || {
                runtime.block_on(async move {
                    match TcpListener::from_std(listener) {
                        Ok(listener) => accept(listener, render, stopped).await,
                        Err(e) => tracing::warn!(%e, "metrics endpoint: the listener cannot serve"),
                    }
                })
            })
            .map_err(listen)?;
        Ok(MetricsEndpoint { addr: bound, stop: Some(stop), join: Some(join) })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsEndpoint {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(join) = self.join.take() {
            let _ = join.join();
        }
    }
}

/// A connection held: its number, whether it has sent a whole request, and how to drop it.
struct Held {
    number: u64,
    answered: Arc<std::sync::atomic::AtomicBool>,
    abort: AbortHandle,
}

type Render = Arc<Mutex<dyn FnMut() -> String + Send>>;

/// Accepts connections until stopped, holding at most [`MAX_CONNECTIONS`].
async fn accept<F: FnMut() -> String + Send + 'static>(
    listener: TcpListener,
    render: Arc<Mutex<F>>,
    mut stopped: tokio::sync::oneshot::Receiver<()>,
) {
    let render: Render = render;
    let held: Arc<Mutex<Vec<Held>>> = Arc::default();
    let mut next = 0u64;
    loop {
        let stream = tokio::select! {
            _ = &mut stopped => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors, say: give it a moment instead of spinning.
                    tracing::debug!(%e, "metrics endpoint: accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        let number = next;
        next += 1;
        let mut table = held.lock().unwrap_or_else(PoisonError::into_inner);
        if table.len() >= MAX_CONNECTIONS {
            // The oldest that has not sent a whole request, else the oldest.
            use std::sync::atomic::Ordering;
            let victim = table.iter().position(|h| !h.answered.load(Ordering::Relaxed)).unwrap_or(0);
            table.remove(victim).abort.abort();
        }
        let answered = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (flag, render, table_ref) = (answered.clone(), render.clone(), held.clone());
        let task = tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                flag.store(true, std::sync::atomic::Ordering::Relaxed);
                let response = respond(&request, &render);
                async move { Ok::<_, std::convert::Infallible>(response) }
            });
            let served = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEAD_TIMEOUT)
                .keep_alive(false)
                .serve_connection(TokioIo::new(stream), service)
                .await;
            if let Err(e) = served {
                tracing::debug!(%e, "metrics endpoint: a connection ended badly");
            }
            table_ref.lock().unwrap_or_else(PoisonError::into_inner).retain(|h| h.number != number);
        });
        table.push(Held { number, answered, abort: task.abort_handle() });
    }
    for h in held.lock().unwrap_or_else(PoisonError::into_inner).drain(..) {
        h.abort.abort();
    }
}

/// `GET` or `HEAD` of [`PATH`]: the rendered text; another path 404, another method 405.
fn respond(request: &Request<Incoming>, render: &Render) -> Response<Full<Bytes>> {
    let status = |code: StatusCode| {
        let mut r = Response::new(Full::new(Bytes::new()));
        *r.status_mut() = code;
        r
    };
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return status(StatusCode::METHOD_NOT_ALLOWED);
    }
    if request.uri().path() != PATH {
        return status(StatusCode::NOT_FOUND);
    }
    let text = (render.lock().unwrap_or_else(PoisonError::into_inner))();
    let mut response = Response::new(Full::new(Bytes::from(text)));
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4"));
    response
}
