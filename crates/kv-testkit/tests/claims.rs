//! D's claim names its own prompt and the P blocks it will read, and P lends its KV only to a
//! claim that names what it computed: a handoff a router rebuilt wrong, or a client edited or
//! replayed, gets P's refusal, and the export it named is freed at once (`rejected`), not at
//! its lease's end. A claim that names the right prompt and blocks holds the export as before.

use kv_core::{BlockId, Claim, Digest, Message, Prompt, RequestId, Time};
use kv_sched_adapter::ReleaseReason;
use kv_testkit::cluster::Cluster;
use kv_testkit::scenario::runner::{apply, cluster_config};
use kv_testkit::scenario::Scenario;

/// A pull cluster in which P exported r1, r2 and r3 (64 tokens each, in 4 blocks) and D is
/// connected to P (it loaded r0).
fn exported() -> Cluster {
    let mut steps = String::new();
    for (i, id) in ["r0", "r1", "r2", "r3"].iter().enumerate() {
        let at = i as f64 * 0.01;
        steps += &format!("[[step]]\nat_s = {at}\ndo = \"prefill\"\nrequest = \"{id}\"\nprompt_tokens = 64\n");
    }
    steps += "[[step]]\nat_s = 0.05\ndo = \"arrive\"\nrequest = \"r0\"\n";
    steps += "[[step]]\nat_s = 0.06\ndo = \"schedule\"\nrequest = \"r0\"\n";
    let scenario = Scenario::from_toml_str(&format!("name = \"claims\"\n{steps}")).unwrap_or_else(|e| panic!("{e}"));
    let mut cluster = Cluster::new(cluster_config(&scenario, 0)).unwrap_or_else(|e| panic!("{e}"));
    for step in &scenario.steps {
        cluster.advance_to(step.at);
        apply(&mut cluster, step.event.as_ref().unwrap()).unwrap();
    }
    cluster.advance_to(Time::from_millis(500));
    assert_eq!(cluster.release_reason("prefill0", &RequestId::new("r0")), Some(ReleaseReason::Transferred));
    cluster
}

fn claim(request: &str, tokens: u64, blocks: &[BlockId]) -> Message {
    Message::Claim(Claim {
        request: RequestId::new(request),
        prompt: Prompt::len_only(tokens),
        blocks: Some(Digest::of_blocks(blocks)),
    })
}

#[test]
fn a_claim_for_another_prompt_or_other_blocks_frees_the_export_at_once() {
    let mut cluster = exported();
    let blocks =
        |id: &str| cluster.transfer_params("prefill0", &RequestId::new(id)).unwrap().export.clone().unwrap().blocks;
    let (b1, b2, b3) = (blocks("r1"), blocks("r2"), blocks("r3"));
    let refused_before = cluster.engine_counters("prefill0").claims_refused;
    // Another prompt's length; r1's blocks.
    cluster.send_as("decode0", "prefill0", &claim("r1", 48, &b1)).unwrap();
    // The right length, another export's blocks (a handoff edited to read r3's KV).
    cluster.send_as("decode0", "prefill0", &claim("r2", 64, &b3)).unwrap();
    // Everything right.
    cluster.send_as("decode0", "prefill0", &claim("r3", 64, &b3)).unwrap();
    cluster.advance_to(Time::from_millis(600));

    assert_eq!(cluster.engine_counters("prefill0").claims_refused, refused_before + 2);
    assert_eq!(cluster.release_reason("prefill0", &RequestId::new("r1")), Some(ReleaseReason::Rejected));
    assert_eq!(cluster.release_reason("prefill0", &RequestId::new("r2")), Some(ReleaseReason::Rejected));
    assert_eq!(cluster.release_reason("prefill0", &RequestId::new("r3")), None, "held for the claimant");
    assert_eq!(cluster.held_blocks("prefill0"), b3.len() as u64, "r1's and r2's blocks are free again");
    assert_ne!(b2, b3);
    assert_eq!(cluster.corrupt_reads(), 0);
}
