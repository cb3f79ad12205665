//! Short leases (issue 30): with the leases vLLM users run, down to 1 s, a healthy queued load
//! reads wherever in the heartbeat cycle it is scheduled, and long after the lease it started
//! with. D's read margin follows the lease and heartbeat cycle; a fixed 5 s margin fenced every
//! read of a 9 s lease late in a cycle, and every read of a 3 s or 5 s lease.
//!
//! Each case is a scenario file (`docs/scenario-format.md`), generated here: P prefills at 0, the request
//! reaches D at 0.1 s (D claims it and beats every lease / 6 from then on), and D schedules it
//! at a point of a heartbeat cycle: on a beat, just before one (the last acknowledged deadline
//! is oldest), just after one (its acknowledgement is still on the way), and at every eighth of
//! the cycle between, in the first cycle and in cycles past the lease and past three leases.

use kv_testkit::scenario::{run, Scenario};

/// Seconds from arrival to each point of the sweep, for a heartbeat interval of `beat` seconds.
fn schedule_points(beat: f64) -> Vec<f64> {
    let mut points = Vec::new();
    for cycle in [0u32, 2, 7, 17] {
        let start = f64::from(cycle) * beat;
        for eighth in 0..8 {
            points.push(start + beat * f64::from(eighth) / 8.0);
        }
        // Around the beat that ends the cycle: the ack of the one before is the newest D has
        // (just before), or the beat's own ack is still on its way back (just after).
        points.push(start + beat - 0.001);
        points.push(start + beat + 0.001);
    }
    points
}

/// The scenario: lease `lease` s, schedule `after` s after the arrival at 0.1 s, and the load
/// read 0.1 s later.
fn scenario(lease: u32, after: f64) -> String {
    let (arrive, schedule) = (0.1, 0.1 + after);
    format!(
        "name = \"lease {lease} s: scheduled {after:.4} s after arrival, it reads\"\n\
         [policy]\nkv_lease_duration_s = {lease}\n\
         [[step]]\nat_s = 0.0\ndo = \"prefill\"\nrequest = \"r1\"\nprompt_tokens = 64\n\
         [[step]]\nat_s = {arrive}\ndo = \"arrive\"\nrequest = \"r1\"\n\
         [[step]]\nat_s = {schedule:.6}\ndo = \"schedule\"\nrequest = \"r1\"\n\
         [[step]]\nat_s = {done:.6}\nexpect = {{ d_state = {{ r1 = \"ready\" }}, p_released = {{ r1 = \"transferred\" }}, \
         p_held_blocks = 0, corrupt_reads = 0 }}\n",
        done = schedule + 0.1,
    )
}

#[test]
fn loads_scheduled_across_the_heartbeat_cycle_of_short_leases_end_ready() {
    let mut failures = Vec::new();
    let mut runs = 0;
    for lease in [1u32, 3, 5, 9] {
        let beat = f64::from(lease) / 6.0;
        for after in schedule_points(beat) {
            let text = scenario(lease, after);
            let parsed = Scenario::from_toml_str(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
            runs += 1;
            if let Some(failure) = run(&parsed, 0).failure {
                failures.push(format!("{}: {failure}", parsed.name));
            }
        }
    }
    assert_eq!(runs, 4 * 40);
    assert!(failures.is_empty(), "{} of {runs} loads did not end ready:\n{}", failures.len(), failures.join("\n"));
}
