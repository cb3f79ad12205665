//! `--discovery etcd`: a real etcd server for the run (Debian's `etcd-server`, which
//! `cargo xtask setup` installs), started before the engines and stopped, its data removed,
//! when the run ends. It listens on the address the engines reach the router's host at:
//! loopback, or the bridge's address with `--hosts netns`, so that an engine whose network is
//! cut can no longer renew its registration.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// How long etcd may take to elect itself and answer its health check.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// A running etcd server; killed and its data removed on drop.
pub(super) struct EtcdServer {
    child: Child,
    data: PathBuf,
    log: PathBuf,
    /// Its client URL, `http://ip:port`.
    pub(super) endpoint: String,
}

impl EtcdServer {
    /// Starts etcd on `ip` with ports of its own and waits until it is healthy.
    pub(super) fn start(ip: Ipv4Addr) -> Result<EtcdServer> {
        let (client, peer) = (free_port(ip)?, free_port(ip)?);
        let data = std::env::temp_dir().join(format!("kvflow-etcd-{}-{client}", std::process::id()));
        let _ = std::fs::remove_dir_all(&data);
        let log_path = data.with_extension("log");
        let log = std::fs::File::create(&log_path).with_context(|| format!("etcd's log {}", log_path.display()))?;
        let endpoint = format!("http://{ip}:{client}");
        let peer_url = format!("http://{ip}:{peer}");
        let child = Command::new("etcd")
            .arg("--name")
            .arg("kvflow")
            .arg("--data-dir")
            .arg(&data)
            .args(["--listen-client-urls", &endpoint, "--advertise-client-urls", &endpoint])
            .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("kvflow={peer_url}"), "--log-level", "error"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            // etcd's raft logs at info whatever --log-level says: kept aside, shown on failure.
            .stderr(log)
            .spawn()
            .context("cannot start `etcd` (Debian's etcd-server; `cargo xtask setup` installs it)")?;
        let mut server = EtcdServer { child, data, log: log_path, endpoint };
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if healthy(SocketAddr::from((ip, client))) {
                return Ok(server);
            }
            if let Ok(Some(status)) = server.child.try_wait() {
                bail!("etcd at {} exited at start: {status}; its log ends:\n{}", server.endpoint, server.log_tail());
            }
            if Instant::now() > deadline {
                bail!(
                    "etcd at {} was not healthy within {START_TIMEOUT:?}; its log ends:\n{}",
                    server.endpoint,
                    server.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl EtcdServer {
    /// The last lines etcd logged.
    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.data);
        let _ = std::fs::remove_file(&self.log);
    }
}

/// A port nobody listens on at `ip` now (the kernel's choice).
fn free_port(ip: Ipv4Addr) -> Result<u16> {
    let listener = TcpListener::bind((ip, 0)).with_context(|| format!("no free port on {ip} for etcd"))?;
    Ok(listener.local_addr()?.port())
}

/// Whether etcd at `addr` answers its `/health` endpoint with `"health":"true"`.
fn healthy(addr: SocketAddr) -> bool {
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else { return false };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
    let request = format!("GET /health HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    if stream.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut answer = String::new();
    let _ = stream.take(4096).read_to_string(&mut answer);
    answer.replace(' ', "").contains("\"health\":\"true\"")
}
