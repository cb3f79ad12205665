//! How transfers of whole blocks name their bytes (`kv_descriptors`): by default as the
//! transport prefers (the fake, like NIXL on host memory without a thread pool, prefers
//! prepared lists, once they are ready), and `"pairs"` or `"prepared"` override it. Either
//! way every byte arrives.

use kv_core::{RequestId, Time};
use kv_sched_adapter::{Config, ExtraConfig};
use kv_testkit::cluster::Cluster;
use kv_testkit::scenario::runner::cluster_config;
use kv_testkit::scenario::Scenario;

/// Runs three requests one after another (the first prepares the lists) in `mode`, the
/// connectors configured with `policy` (TOML) as `kv_connector_extra_config`; returns the transfers
/// decode0 read, and prefill0 wrote, by prepared indices.
fn run(mode: &str, policy: &str) -> (u64, u64) {
    let text = format!("name = \"descriptors\"\n[cluster]\nmode = \"{mode}\"\n");
    let scenario = Scenario::from_toml_str(&text).unwrap_or_else(|e| panic!("{e}"));
    let mut config = cluster_config(&scenario, 0);
    let extra: ExtraConfig = toml::from_str(policy).unwrap_or_else(|e| panic!("{policy}: {e}"));
    config.connector.descriptors = Config::from_extra(&extra).unwrap_or_else(|e| panic!("{e}")).descriptors;
    let mut cluster = Cluster::new(config).unwrap_or_else(|e| panic!("{e}"));
    for i in 0..3u64 {
        let r = RequestId::new(format!("r{i}"));
        let at = Time::from_millis(500 * i);
        cluster.advance_to(at);
        if mode == "push" {
            cluster.arrive("decode0", &r, "prefill0", &r, Some(64), None).unwrap();
            cluster.schedule("decode0", &r, false).unwrap();
            cluster.prefill("prefill0", &r, 64, 1, None).unwrap();
        } else {
            cluster.prefill("prefill0", &r, 64, 1, None).unwrap();
            cluster.arrive("decode0", &r, "prefill0", &r, None, None).unwrap();
            cluster.schedule("decode0", &r, false).unwrap();
        }
        cluster.advance_to(at + std::time::Duration::from_millis(400));
        assert_eq!(cluster.decode_state("decode0", &r).map(|s| s.as_str()), Some("ready"), "{mode} {policy}: {r}");
    }
    assert_eq!(cluster.corrupt_reads(), 0, "{mode} {policy}");
    (cluster.engine_counters("decode0").prepared_reads, cluster.engine_counters("prefill0").prepared_writes)
}

#[test]
fn the_override_decides_how_blocks_are_named_and_every_byte_arrives() {
    let (reads, _) = run("pull", "");
    assert!(reads > 0, "by default the fake's preference, prepared lists, once ready: {reads}");
    assert_eq!(run("pull", r#"kv_descriptors = "prepared""#).0, reads);
    assert_eq!(run("pull", r#"kv_descriptors = "pairs""#).0, 0, "pairs: no read by index");
    let (_, writes) = run("push", "");
    assert!(writes > 0, "push: by default prepared lists, once ready: {writes}");
    assert_eq!(run("push", r#"kv_descriptors = "pairs""#).1, 0, "pairs: no write by index");
}
