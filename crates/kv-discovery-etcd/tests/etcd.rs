//! The etcd adapter against a real etcd server: each test starts its own `etcd` on free
//! loopback ports with a data folder of its own, and kills it when it ends.
//!
//! Where no `etcd` binary is installed (Debian's `etcd-server`; `cargo xtask setup` installs
//! it), a test says `skipped NAME: REASON` and passes, except under `CI=true`, where it fails.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use etcd_client::{Client, ConnectOptions, PutOptions, Txn, TxnOp};
use kv_core::discovery::{Change, Discovery, DiscoveryError, EngineRecord, Watch};
use kv_core::{EngineId, KvLayout, Role};
use kv_discovery_etcd::{ConfigError, ConnectError, EtcdConfig, EtcdDiscovery, MAX_RECORDS, MAX_VALUE_LEN};

/// The lease TTL of these tests: etcd's minimum at its default election settings.
const TTL: Duration = Duration::from_secs(2);

/// An etcd server of one test, killed and its data folder removed on drop.
struct Etcd {
    binary: PathBuf,
    dir: PathBuf,
    client_url: String,
    peer_url: String,
    child: Option<Child>,
}

impl Etcd {
    /// Starts etcd and waits until it answers; `None` (after saying so) where there is no
    /// etcd binary and CI is not set.
    /// A port found free may be taken before etcd binds it (the tests run at once, and their
    /// clients' connections take ports too): etcd then exits at once saying so, and this tries
    /// again on other ports, three times at most.
    async fn start(test: &str) -> Option<Etcd> {
        let binary = etcd_binary(test)?;
        let dir = std::env::temp_dir().join(format!("kvflow-etcd-{test}-{}", std::process::id()));
        for attempt in 1.. {
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            let mut etcd = Etcd {
                binary: binary.clone(),
                dir: dir.clone(),
                client_url: format!("http://127.0.0.1:{}", free_port()),
                peer_url: format!("http://127.0.0.1:{}", free_port()),
                child: None,
            };
            etcd.launch();
            match etcd.wait_ready().await {
                Ok(()) => return Some(etcd),
                Err(log) if attempt < 3 && log.contains("address already in use") => continue,
                Err(log) => panic!("{log}"),
            }
        }
        unreachable!("the loop returns or panics by its third attempt")
    }

    async fn spawn(&mut self) {
        self.launch();
        if let Err(log) = self.wait_ready().await {
            panic!("{log}");
        }
    }

    fn launch(&mut self) {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.log()).unwrap();
        let child = Command::new(&self.binary)
            .arg("--name=default")
            .arg(format!("--data-dir={}", self.dir.join("data").display()))
            .arg(format!("--listen-client-urls={}", self.client_url))
            .arg(format!("--advertise-client-urls={}", self.client_url))
            .arg(format!("--listen-peer-urls={}", self.peer_url))
            .arg(format!("--initial-advertise-peer-urls={}", self.peer_url))
            .arg(format!("--initial-cluster=default={}", self.peer_url))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.binary.display()));
        self.child = Some(child);
    }

    fn log(&self) -> PathBuf {
        self.dir.join("etcd.log")
    }

    /// Waits until etcd answers; else what went wrong, with the tail of its log.
    async fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().unwrap()) {
                return Err(format!("etcd exited ({status}) before it answered:\n{}", log_tail(&self.log())));
            }
            let options = ConnectOptions::new().with_connect_timeout(Duration::from_millis(500));
            if let Ok(mut client) = Client::connect([&self.client_url], Some(options)).await {
                if tokio::time::timeout(Duration::from_secs(1), client.status()).await.is_ok_and(|s| s.is_ok()) {
                    return Ok(());
                }
            }
            if Instant::now() >= deadline {
                return Err(format!("etcd did not answer within 20 s:\n{}", log_tail(&self.log())));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Kills the server (SIGKILL: nothing closes cleanly) and waits for it to be gone.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same ports and data.
    async fn restart(&mut self) {
        self.kill();
        self.spawn().await;
    }

    fn config(&self) -> EtcdConfig {
        EtcdConfig { endpoints: vec![self.client_url.clone()], prefix: "/kvflow".into(), ttl: TTL }
    }

    async fn connect(&self) -> EtcdDiscovery {
        EtcdDiscovery::connect(self.config()).await.unwrap()
    }

    /// A plain etcd client, for what the tests do behind the adapter's back.
    async fn client(&self) -> Client {
        Client::connect([&self.client_url], None).await.unwrap()
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The etcd binary, on `PATH` or at `/usr/bin/etcd`.
fn etcd_binary(test: &str) -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .and_then(|path| std::env::split_paths(&path).map(|dir| dir.join("etcd")).find(|c| c.is_file()));
    let found = on_path.or_else(|| Some(PathBuf::from("/usr/bin/etcd")).filter(|p| p.is_file()));
    if found.is_none() {
        let why = "no etcd binary on PATH or at /usr/bin/etcd (Debian's etcd-server; `cargo xtask setup` installs it)";
        assert!(std::env::var("CI").as_deref() != Ok("true"), "{test}: {why}, and CI=true requires this test to run");
        eprintln!("skipped {test}: {why}");
    }
    found
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

fn record(name: &str, instance: u64) -> EngineRecord {
    EngineRecord {
        engine: EngineId::new(name),
        instance,
        role: Role::Decode,
        addresses: vec![format!("127.0.0.1:{}", 5600 + instance), format!("127.0.0.1:{}", 6600 + instance)],
        layout: KvLayout::llama3_8b(16),
        tp_size: 2,
    }
}

fn down(name: &str, instance: u64) -> Change {
    Change::Down { engine: EngineId::new(name), instance }
}

/// The next change, within `within`.
async fn next(watch: &mut Box<dyn Watch>, within: Duration) -> Change {
    match tokio::time::timeout(within, watch.next()).await {
        Ok(Ok(change)) => change,
        Ok(Err(err)) => panic!("the watch failed: {err}"),
        Err(_) => panic!("no change within {within:?}"),
    }
}

/// Asserts that the watch reports nothing for `quiet`.
async fn quiet(watch: &mut Box<dyn Watch>, quiet: Duration) {
    if let Ok(change) = tokio::time::timeout(quiet, watch.next()).await {
        panic!("expected no change for {quiet:?}, got {change:?}");
    }
}

/// How many leases etcd holds.
async fn leases(client: &mut Client) -> usize {
    client.leases().await.unwrap().leases().len()
}

const SOON: Duration = Duration::from_secs(2);

#[tokio::test]
async fn a_published_record_resolves_lists_and_watches_up() {
    let Some(etcd) = Etcd::start("a_published_record_resolves_lists_and_watches_up").await else { return };
    let (publisher, peer) = (etcd.connect().await, etcd.connect().await);
    let mut before = peer.watch().await.unwrap();
    publisher.publish(&record("p0", 1)).await.unwrap();

    assert_eq!(next(&mut before, SOON).await, Change::Up(record("p0", 1)));
    assert_eq!(peer.resolve(&EngineId::new("p0")).await.unwrap(), Some(record("p0", 1)));
    assert_eq!(peer.resolve(&EngineId::new("nobody")).await.unwrap(), None);
    assert_eq!(peer.list().await.unwrap(), vec![record("p0", 1)]);
    let mut after = peer.watch().await.unwrap();
    assert_eq!(next(&mut after, SOON).await, Change::Up(record("p0", 1)), "a watch starts with what is there");

    // The value is the record as JSON, under {prefix}/engines/{engine}, with a lease.
    let mut client = etcd.client().await;
    let stored = client.get("/kvflow/engines/p0", None).await.unwrap();
    let kv = &stored.kvs()[0];
    let json: serde_json::Value = serde_json::from_slice(kv.value()).unwrap();
    assert_eq!(json["engine"], "p0");
    assert_eq!(json["instance"], 1);
    assert_ne!(kv.lease(), 0, "the record is published under a lease");
    assert_eq!(peer.bad_records(), 0);
}

#[tokio::test]
async fn a_withdrawn_engine_goes_down_with_its_incarnation() {
    let Some(etcd) = Etcd::start("a_withdrawn_engine_goes_down_with_its_incarnation").await else { return };
    let (publisher, peer) = (etcd.connect().await, etcd.connect().await);
    publisher.publish(&record("d0", 3)).await.unwrap();
    let mut watch = peer.watch().await.unwrap();
    assert_eq!(next(&mut watch, SOON).await, Change::Up(record("d0", 3)));

    publisher.withdraw().await.unwrap();
    assert_eq!(next(&mut watch, SOON).await, down("d0", 3));
    assert_eq!(peer.resolve(&EngineId::new("d0")).await.unwrap(), None);
    assert_eq!(leases(&mut etcd.client().await).await, 0, "withdraw revokes the lease");
    publisher.withdraw().await.unwrap();
}

#[tokio::test]
async fn a_publisher_that_stops_keeping_alive_goes_down_within_the_ttl_and_a_second() {
    let test = "a_publisher_that_stops_keeping_alive_goes_down_within_the_ttl_and_a_second";
    let Some(etcd) = Etcd::start(test).await else { return };
    let (publisher, peer) = (etcd.connect().await, etcd.connect().await);
    publisher.publish(&record("p0", 5)).await.unwrap();
    let mut watch = peer.watch().await.unwrap();
    assert_eq!(next(&mut watch, SOON).await, Change::Up(record("p0", 5)));
    // Kept alive past its TTL while the publisher lives.
    quiet(&mut watch, TTL + Duration::from_millis(500)).await;

    // A dead host: its handle stops renewing and revokes nothing.
    let stopped = Instant::now();
    drop(publisher);
    assert_eq!(next(&mut watch, TTL + Duration::from_secs(3)).await, down("p0", 5));
    let took = stopped.elapsed();
    eprintln!("{test}: Down {:.2} s after the keep-alive stopped (TTL {} s)", took.as_secs_f64(), TTL.as_secs());
    assert!(took <= TTL + Duration::from_secs(1), "Down took {took:?}, over the TTL {TTL:?} plus 1 s");
    // The last renewal was at most TTL/3 before the drop: sooner, and dropping revoked it.
    assert!(took >= TTL - TTL / 3 - Duration::from_millis(200), "Down after {took:?}: the drop revoked the lease");
}

#[tokio::test]
async fn a_lapsed_registration_is_reported_by_the_publishers_watches() {
    let Some(etcd) = Etcd::start("a_lapsed_registration_is_reported_by_the_publishers_watches").await else { return };
    let publisher = etcd.connect().await;
    publisher.publish(&record("p0", 1)).await.unwrap();
    let mut watch = publisher.watch().await.unwrap();
    assert_eq!(next(&mut watch, SOON).await, Change::Up(record("p0", 1)));
    assert_eq!(watch.registration_error(), None);

    // etcd forgets the lease behind the publisher's back (as when it expired during a stall).
    let mut client = etcd.client().await;
    for lease in client.leases().await.unwrap().leases().to_vec() {
        client.lease_revoke(lease.id()).await.unwrap();
    }
    assert_eq!(next(&mut watch, SOON).await, down("p0", 1));
    let deadline = Instant::now() + TTL;
    while watch.registration_error().is_none() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(watch.registration_error(), Some(DiscoveryError::Lapsed { engine: "p0".into(), instance: 1 }));

    // A new incarnation publishes afresh, and the error is cleared.
    publisher.publish(&record("p0", 2)).await.unwrap();
    assert_eq!(watch.registration_error(), None);
    assert_eq!(next(&mut watch, SOON).await, Change::Up(record("p0", 2)));
}

#[tokio::test]
async fn a_registration_that_cannot_be_renewed_lapses_at_its_deadline() {
    let test = "a_registration_that_cannot_be_renewed_lapses_at_its_deadline";
    let Some(mut etcd) = Etcd::start(test).await else { return };
    let publisher = etcd.connect().await;
    publisher.publish(&record("p0", 4)).await.unwrap();
    let watch = publisher.watch().await.unwrap();
    // Renewed a few times first; the kill then lands between two renewals.
    tokio::time::sleep(TTL + TTL / 6).await;
    assert_eq!(watch.registration_error(), None);

    // etcd is gone: no renewal is answered, so the lease must be taken as lapsed before it
    // could expire (a TTL after the last answered renewal, which came before the kill): by a
    // quarter of the TTL before, so that the engine stops before its peers can act.
    let killed = Instant::now();
    etcd.kill();
    while watch.registration_error().is_none() && killed.elapsed() < TTL + Duration::from_secs(1) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = killed.elapsed();
    eprintln!("{test}: reported lapsed {:.2} s after etcd was killed (TTL {} s)", took.as_secs_f64(), TTL.as_secs());
    assert_eq!(watch.registration_error(), Some(DiscoveryError::Lapsed { engine: "p0".into(), instance: 4 }));
    // The last answered renewal was sent before the kill, so three quarters of a TTL after the
    // kill at the latest (give or take the scheduling of a busy machine).
    let fence = TTL * 3 / 4;
    assert!(
        took <= fence + Duration::from_millis(200),
        "reported lapsed {took:?} after the kill, past the fence {fence:?}"
    );
}

#[tokio::test]
async fn republishing_with_a_higher_instance_reports_up_with_it_and_keeps_one_lease() {
    let test = "republishing_with_a_higher_instance_reports_up_with_it_and_keeps_one_lease";
    let Some(etcd) = Etcd::start(test).await else { return };
    let (publisher, peer) = (etcd.connect().await, etcd.connect().await);
    publisher.publish(&record("p0", 1)).await.unwrap();
    let mut watch = peer.watch().await.unwrap();
    assert_eq!(next(&mut watch, SOON).await, Change::Up(record("p0", 1)));

    publisher.publish(&record("p0", 2)).await.unwrap();
    assert_eq!(next(&mut watch, SOON).await, Change::Up(record("p0", 2)), "no Down between incarnations");
    assert_eq!(peer.resolve(&EngineId::new("p0")).await.unwrap(), Some(record("p0", 2)));
    assert_eq!(leases(&mut etcd.client().await).await, 1, "the replaced lease is revoked");
    // The new lease is kept alive past its TTL, and the old one's keep-alive reports nothing.
    quiet(&mut watch, TTL + Duration::from_millis(500)).await;
    assert_eq!(peer.resolve(&EngineId::new("p0")).await.unwrap(), Some(record("p0", 2)));
    assert_eq!(publisher.watch().await.unwrap().registration_error(), None);

    // Publishing another engine on the same handle replaces the first, which goes down.
    publisher.publish(&record("p1", 1)).await.unwrap();
    assert_eq!(next(&mut watch, SOON).await, Change::Up(record("p1", 1)));
    assert_eq!(next(&mut watch, SOON).await, down("p0", 2));
}

#[tokio::test]
async fn values_that_are_not_records_are_skipped_and_counted_never_a_panic() {
    let test = "values_that_are_not_records_are_skipped_and_counted_never_a_panic";
    let Some(etcd) = Etcd::start(test).await else { return };
    let (publisher, peer) = (etcd.connect().await, etcd.connect().await);
    publisher.publish(&record("p1", 1)).await.unwrap();
    let mut client = etcd.client().await;
    client.put("/kvflow/engines/junk", "not json at all", None).await.unwrap();
    client.put("/kvflow/engines/elsewhere", serde_json::to_vec(&record("p9", 1)).unwrap(), None).await.unwrap();
    client.put("/kvflow/engines/huge", vec![b' '; MAX_VALUE_LEN + 1], None).await.unwrap();

    assert_eq!(peer.list().await.unwrap(), vec![record("p1", 1)]);
    assert_eq!(peer.bad_records(), 3);
    match peer.resolve(&EngineId::new("junk")).await {
        Err(DiscoveryError::BadRecord { engine, why }) => {
            assert_eq!(engine, "junk");
            assert!(why.contains("not an engine record"), "{why}");
        }
        other => panic!("resolving junk gave {other:?}"),
    }
    let mut watch = peer.watch().await.unwrap();
    assert_eq!(next(&mut watch, SOON).await, Change::Up(record("p1", 1)), "the listing skips what is not a record");

    // Garbage arriving on the watch is skipped, and the watch goes on.
    client.put("/kvflow/engines/junk2", vec![0xff, 0x00, 0x7b], None).await.unwrap();
    publisher.publish(&record("p1", 2)).await.unwrap();
    assert_eq!(next(&mut watch, SOON).await, Change::Up(record("p1", 2)));
    // A record overwritten with garbage is gone.
    client.put("/kvflow/engines/p1", "{\"engine\":", Some(PutOptions::new())).await.unwrap();
    assert_eq!(next(&mut watch, SOON).await, down("p1", 2));
    assert!(peer.bad_records() >= 6, "counted {}", peer.bad_records());
}

#[tokio::test]
async fn a_listing_is_read_in_pages_and_refused_over_its_bound_naming_the_count() {
    let test = "a_listing_is_read_in_pages_and_refused_over_its_bound_naming_the_count";
    let Some(etcd) = Etcd::start(test).await else { return };
    let peer = etcd.connect().await;
    let mut client = etcd.client().await;
    // 40 records: three pages.
    let records: Vec<EngineRecord> = (0..40).map(|i| record(&format!("d{i:02}"), 1)).collect();
    let puts: Vec<TxnOp> = records
        .iter()
        .map(|r| TxnOp::put(format!("/kvflow/engines/{}", r.engine), serde_json::to_vec(r).unwrap(), None))
        .collect();
    client.txn(Txn::new().and_then(puts)).await.unwrap();
    assert_eq!(peer.list().await.unwrap(), records);

    // Fill up to one key over the bound, in transactions of 100 (etcd's limit is 128).
    let extra: Vec<String> = (records.len()..=MAX_RECORDS).map(|i| format!("/kvflow/engines/x{i:05}")).collect();
    for chunk in extra.chunks(100) {
        let puts: Vec<TxnOp> = chunk.iter().map(|key| TxnOp::put(key.as_str(), "x", None)).collect();
        client.txn(Txn::new().and_then(puts)).await.unwrap();
    }
    let err = peer.list().await.unwrap_err().to_string();
    assert!(err.contains("4097 keys under /kvflow/engines/, over the limit of 4096"), "{err}");
    assert!(peer.watch().await.is_err(), "a watch starts with a listing, refused the same way");
}

#[tokio::test]
async fn a_watch_reconnects_after_etcd_restarts_resuming_or_resyncing_after_compaction() {
    let test = "a_watch_reconnects_after_etcd_restarts_resuming_or_resyncing_after_compaction";
    let Some(mut etcd) = Etcd::start(test).await else { return };
    // Leases that outlive the restart: this test is about watches, not lapses.
    let config = EtcdConfig { ttl: Duration::from_secs(20), ..etcd.config() };
    let connect = || EtcdDiscovery::connect(config.clone());
    let (a, c, peer) = (connect().await.unwrap(), connect().await.unwrap(), connect().await.unwrap());
    a.publish(&record("a", 1)).await.unwrap();
    let (mut resumes, mut resyncs) = (peer.watch().await.unwrap(), peer.watch().await.unwrap());
    for watch in [&mut resumes, &mut resyncs] {
        assert_eq!(next(watch, SOON).await, Change::Up(record("a", 1)));
    }
    c.publish(&record("c", 1)).await.unwrap();
    for watch in [&mut resumes, &mut resyncs] {
        assert_eq!(next(watch, SOON).await, Change::Up(record("c", 1)), "delivered by the stream");
    }

    etcd.kill();
    for watch in [&mut resumes, &mut resyncs] {
        match tokio::time::timeout(Duration::from_secs(10), watch.next()).await {
            Ok(Err(DiscoveryError::Registry { .. })) => {}
            other => panic!("a broken watch should report it once, got {other:?}"),
        }
    }
    etcd.restart().await;
    let b = connect().await.unwrap();
    b.publish(&record("b", 1)).await.unwrap();
    a.withdraw().await.unwrap();

    // Resumed from the last revision seen: every event, in order.
    assert_eq!(next(&mut resumes, Duration::from_secs(10)).await, Change::Up(record("b", 1)));
    assert_eq!(next(&mut resumes, SOON).await, down("a", 1));

    // Compacted past where the other watch stood: it lists afresh and reports the difference.
    let mut client = etcd.client().await;
    let revision = client.get("/", None).await.unwrap().header().unwrap().revision();
    client.compact(revision, None).await.unwrap();
    assert_eq!(next(&mut resyncs, Duration::from_secs(10)).await, down("a", 1));
    assert_eq!(next(&mut resyncs, SOON).await, Change::Up(record("b", 1)));
    quiet(&mut resyncs, Duration::from_millis(300)).await;
    quiet(&mut resumes, Duration::from_millis(10)).await;
}

#[tokio::test]
async fn a_config_that_cannot_work_is_refused_naming_the_value() {
    let refused = |config: EtcdConfig| async move {
        match EtcdDiscovery::connect(config).await {
            Err(err) => err,
            Ok(_) => panic!("connected with a config that cannot work"),
        }
    };
    let config = |ttl: Duration| EtcdConfig { ttl, ..EtcdConfig::default() };
    let err = refused(config(Duration::ZERO)).await;
    assert!(matches!(err, ConnectError::Config(ConfigError::Ttl { ttl: Duration::ZERO, .. })), "{err:?}");
    assert_eq!(err.to_string(), "etcd lease ttl 0ns: shorter than the minimum of 1s");
    let err = refused(config(Duration::from_millis(1500))).await;
    assert_eq!(err.to_string(), "etcd lease ttl 1.5s: not a whole number of seconds, which is all etcd's leases count");
    let err = refused(EtcdConfig { endpoints: vec![], ..EtcdConfig::default() }).await;
    assert_eq!(err.to_string(), "no etcd endpoints given");

    // Nothing listens there: refused at connect, naming the endpoint.
    let nowhere = format!("http://127.0.0.1:{}", free_port());
    let err = refused(EtcdConfig { endpoints: vec![nowhere.clone()], ..EtcdConfig::default() }).await;
    assert!(
        matches!(&err, ConnectError::Registry(DiscoveryError::Registry { endpoint, .. }) if *endpoint == nowhere),
        "{err:?}"
    );
}
